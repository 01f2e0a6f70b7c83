"""benchmarks/bench_lora.py on CPU: the dry run builds every way (Liger recorded as skipped
without a GPU), checks PEFT's and ours against float64 on every train row, renders, and bad
arguments are one-line errors."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_lora


def test_dry_run_checks_every_way_against_float64(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path), "--commit", "abc123", "--ranks", "4", "--ms", "9", "--decode-ms", "1"]
    assert bench_lora.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["kind"] == "bench_lora" and data["env"]["git"]["commit"] == "abc123"
    assert "liger" in data["skipped"]
    assert [(r["phase"], r["m"]) for r in data["rows"]] == [("train", 9), ("infer", 9), ("infer", 1)]
    errors = data["rows"][0]["errors"]
    assert set(errors) == {"peft", "ours"}
    for way, errs in errors.items():  # fp32 against float64: the adapters' gradients reached, and right
        assert set(errs) == {"y", "dx", "adapters"} and max(errs.values()) < 1e-5, (way, errs)
    per_call = data["rows"][2]["per_call"]  # the decode row, timed per call as generate makes them
    assert set(per_call) == {"peft", "ours", "base"}
    assert all(0 < t["host_us"] and 0 < t["eager_us"] for t in per_call.values())
    md = (tmp_path / "results.md").read_text()
    assert "| train | 4 | 9 |" in md and "liger: not run" in md and "| 4 | 1 | " in md
    (tmp_path / "results.md").unlink()
    assert bench_lora.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md


@pytest.mark.parametrize("argv, message", [
    (["--dry-run"], "--out is required"),
    (["--out", "x", "--ranks", "0"], "ranks"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_lora.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
