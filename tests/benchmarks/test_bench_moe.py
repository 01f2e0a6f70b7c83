"""benchmarks/bench_moe.py: the whole script on CPU (--dry-run) with sweep candidates, the eager-loop
timer, and the report's loop section."""

import json

import pytest

from benchmarks.bench_moe import _loop_us, main, render_markdown, sweep_configs
from benchmarks.harness.host_time import in_turns


@pytest.mark.slow
def test_dry_run_checks_every_way_and_candidate_against_float64(tmp_path):
    from swiglu_patch.kernels.device import interpreting

    if not interpreting():
        pytest.skip("the dry run is the CPU interpreter's")
    assert main(["--dry-run", "--out", str(tmp_path), "--sweep", "--sweep-configs", "grouped", "gemv"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["tokens"] for r in results["rows"]] == [1, 5, 37]
    for row in results["rows"]:
        assert {"ours", "grouped_mm", "ours[grouped]", "ours[gemv]"} <= set(row["errors"])
        assert max(row["errors"].values()) < 1e-5, row["errors"]  # fp32 against float64


def test_every_sweep_candidate_names_an_experts_kernel():
    from swiglu_patch.kernels.experts import EXPERTS_KERNELS

    configs = sweep_configs()
    assert {"grouped", "gemv"} <= set(configs)
    assert all(kernel in EXPERTS_KERNELS for kernel, _ in configs.values())


def test_the_loop_timer_counts_per_call_and_takes_turns():
    calls = {"a": 0, "b": 0}

    def way(name):
        def f():
            calls[name] += 1
        return f

    us = _loop_us({"a": way("a"), "b": way("b")}, 7, lambda: None, in_turns)
    assert set(us) == {"a", "b"} and all(v > 0 for v in us.values())
    assert calls == {"a": 7 * 6, "b": 7 * 6}  # a warm-up loop, then 5 rounds of 7 calls


def test_the_report_has_a_loop_section_when_the_rows_have_loop_times():
    row = {"shape": "s", "routing": "uniform", "tokens": 1, "us": {"ours": 10.0}, "errors": {"ours": 1e-3},
           "floor_us": 5.0, "loop_us": {"ours": 40.0, "ours[grouped]": 80.0}}
    data = {"environment": {}, "dtype": "torch.bfloat16", "matmul_peak_tflops": 800.0, "timer": "t", "rows": [row]}
    text = render_markdown(data)
    assert "## Eager calls back to back" in text
    assert "| s | uniform | 1 | 40.0 | 80.0 |" in text
    assert "## Eager calls back to back" not in render_markdown(dict(data, rows=[dict(row, loop_us={})]))
