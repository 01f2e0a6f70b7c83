"""benchmarks/bench_moe_train.py: the targets' verdicts by hand, the whole script on CPU (--dry-run), and its
one-line errors."""

import json

import pytest

from benchmarks.bench_moe_train import main, targets


def test_targets_by_hand():
    errs = {"x": 3e-3, "top_k_weights": 4e-3}
    ways = {"grouped_mm": {"ms": 18.0, "saved_mib": 1346, "errors": errs},
            "liger": {"ms": 14.0, "saved_mib": 450},
            "ours_store": {"ms": 9.0, "saved_mib": 384, "errors": {"x": 6e-3, "top_k_weights": 1e-3}},
            "ours_recompute": {"ms": 10.5, "saved_mib": 0, "errors": {"x": 6.1e-3, "top_k_weights": 1e-3}}}
    t = targets(ways)
    assert t["store: >= 2x grouped_mm's speed"] is True  # 18 / 9 = 2.0
    assert t["store: >= 1.6x Liger's speed"] is False  # 14 / 9 = 1.56
    assert t["store: saved <= Liger's"] is True
    assert t["store: every gradient within 2x grouped_mm's error"] is True  # 6e-3 <= 2 * 3e-3
    assert t["recompute: >= 2x grouped_mm's speed"] is False
    assert t["recompute: every gradient within 2x grouped_mm's error"] is False  # 6.1e-3 > 6e-3
    assert targets({"ours_store": {"ms": 1.0}})["store: >= 2x grouped_mm's speed"] is None


@pytest.mark.slow
def test_dry_run_writes_every_way_with_gradient_errors(tmp_path):
    from swiglu_patch.kernels.device import interpreting

    if not interpreting():
        with pytest.raises(SystemExit) as e:  # one line: the dry run needs the interpreter
            main(["--dry-run", "--out", str(tmp_path)])
        assert e.value.code == 2
        return
    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["kind"] == "moe_train" and results["rows"]
    for row in results["rows"]:
        assert {"ours_store", "ours_recompute", "grouped_mm", "eager"} <= set(row["ways"])
        for way, v in row["ways"].items():
            assert set(v["errors"]) == {"x", "top_k_weights", "gate_up_proj", "down_proj"}, way
            assert v["max_error"] < 1e-5, (way, v["errors"])  # fp32 against float64
        assert row["targets"]["store: every gradient within 2x grouped_mm's error"] is not None
    assert "| ours_store |" in (tmp_path / "results.md").read_text()


def test_no_gpu_and_no_dry_run_is_one_line_and_exit_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dry-run" in err


def _interpreting() -> bool:
    from swiglu_patch.kernels.device import interpreting

    return interpreting()


@pytest.mark.skipif(not _interpreting(), reason="the dry run runs the kernels in Triton's interpreter")
def test_sweep_only_checks_each_config_against_the_rule_and_flushes_after_each(tmp_path, monkeypatch):
    import benchmarks.bench_moe_train as bench

    calls = []
    real = bench.max_rel_diff

    def cut_after_first(ours, ref):  # the run's time limit, arriving during the second config
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(ours, ref)
    monkeypatch.setattr(bench, "max_rel_diff", cut_after_first)
    with pytest.raises(KeyboardInterrupt):
        main(["--dry-run", "--out", str(tmp_path), "--sweep-only", "--sweep-configs", "w4", "dh64"])
    kept = json.loads((tmp_path / "results.json").read_text())
    (row,) = kept["rows"]
    assert row["ways"] == {} and list(row["sweep"]["configs"]) == ["w4"]
    assert row["sweep"]["configs"]["w4"]["max_rel_diff_vs_rule"] < 1e-5  # fp32: the same gradients as the rule's
    assert row["sweep"]["configs"]["w4"]["config"]["num_warps"] == 4


@pytest.mark.skipif(not _interpreting(), reason="the dry run runs the kernels in Triton's interpreter")
def test_spent_budget_starts_nothing_and_says_so(tmp_path):
    assert main(["--dry-run", "--out", str(tmp_path), "--sweep-configs", "w4", "--budget-s", "1e-9"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["rows"] == [] and data["not_started"] == ["tiny T=5", "tiny T=37"]
    assert "Rows not started" in (tmp_path / "results.md").read_text()


def test_sweep_names_are_the_configs_the_command_line_offers():
    from benchmarks.bench_moe_train import SWEEP_NAMES, sweep_configs

    configs = sweep_configs()
    assert list(configs) == list(SWEEP_NAMES) and configs["rule"] is None
    assert all(c.block_m % 16 == 0 for name, c in configs.items() if c is not None)  # the wgrad kernels' tl.dot
