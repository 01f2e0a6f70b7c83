"""benchmarks/summarize.py: the regime table and decode fit the README quotes, reproduced from
the committed H100 results; the least-squares fit and run-to-run spread by hand; errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import summarize
from benchmarks.harness.roofline import min_bytes
from benchmarks.summarize import decode_fit, run_to_run

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_committed_summary_is_what_summarize_prints(gpu, tmp_path, capsys):
    folder = RESULTS / gpu / "mlp"
    assert summarize.main([str(folder / "results.json"), "--out", str(tmp_path / "summary.md")]) == 0
    assert (tmp_path / "summary.md").read_text() == (folder / "summary.md").read_text()
    assert capsys.readouterr().out == (folder / "summary.md").read_text()


def test_compare_prints_the_spread(capsys):
    path = str(RESULTS / "h100" / "mlp" / "results.json")
    assert summarize.main([path, "--compare", path]) == 0
    assert "| ours | M >= 512 | 1.000 | 1.000 | 1.000 |" in capsys.readouterr().out


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.json", "missing.json: no such file"),
    (lambda d: (d / "e2e.json", (d / "e2e.json").write_text('{"kind": "bench_e2e"}'))[0], "not a bench_mlp"),
])
def test_bad_inputs_are_one_line_errors(make, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        summarize.main([str(make(tmp_path))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_decode_fit_recovers_bandwidth_and_fixed_cost():
    rows = []
    for k, i in [(2048, 8192), (4096, 14336), (8192, 28672)]:
        weight = 2 * i * k * 2  # bf16
        us = weight / 3.0e12 * 1e6 + 7.0  # 3 TB/s plus 7 µs per call
        rows.append({"dtype": "bfloat16", "M": 1, "K": k, "I": i, "min_bytes": min_bytes(1, k, i, 2),
                     "ways": {"ours": {"status": "ok", "us": us}, "gemm_only": {"status": "failed"}}})
    tbps, fixed = decode_fit(rows, "ours", "bfloat16")
    assert tbps == pytest.approx(3.0, rel=1e-9) and fixed == pytest.approx(7.0, rel=1e-9)
    assert decode_fit(rows, "gemm_only", "bfloat16") is None  # no timed rows




def test_run_to_run_spread_by_hand():
    """summarize --compare: per-way ratios of the rows two runs share at M >= 512."""
    def row(m, ours, gemm, shape="a"):
        return {"dtype": "bfloat16", "shape": shape, "M": m,
                "ways": {"ours": {"status": "ok", "us": ours}, "gemm_only": {"status": "ok", "us": gemm}}}

    old = [row(512, 10.0, 10.0), row(1024, 20.0, 20.0), row(16, 5.0, 5.0), row(2048, 1.0, 1.0, shape="gone")]
    new = [row(512, 11.0, 10.0), row(1024, 19.0, 20.0), row(16, 50.0, 5.0)]
    assert run_to_run(new, old, "ours") == pytest.approx((1.025, 0.95, 1.1))  # median of two
    assert run_to_run(new, old, "gemm_only") == pytest.approx((1.0, 1.0, 1.0))
    assert run_to_run(new, [], "ours") is None
