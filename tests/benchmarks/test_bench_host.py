"""benchmarks/bench_host.py on CPU: the dry run times every way that runs on CPU and profiles the
patched MLP forward, the targets are judged from the JSON alone, bad arguments are one-line errors."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_host


def test_dry_run_times_the_ways_and_profiles(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path), "--calls", "6", "--rounds", "2", "--profile", "--profile-calls", "3",
            "--commit", "abc123"]
    assert bench_host.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["kind"] == "bench_host" and data["env"]["git"]["commit"] == "abc123"
    assert data["shape"]["M"] == 1 and data["settings"]["dry_run"]
    for way in ("gated_linear", "F.linear", "mlp_eager", "mlp_patched", "mlp_train_eager", "mlp_train_patched"):
        w = data["ways"][way]
        assert w["calls"] == 6 and 0 < w["p10_us"] <= w["median_us"] <= w["p90_us"], way
    assert "interpreter" in data["ways"]["gated_gemm"]["skipped"]
    profile = (tmp_path / "profile_mlp_patched.txt").read_text()
    assert "cProfile of 3 calls" in profile and "swiglu_patch" in profile  # the patched path ran
    md = (tmp_path / "results.md").read_text()
    assert "| `mlp_patched` |" in md and "| `mlp_train_patched` |" in md
    assert "## Where the patched MLP forward's host time goes" in md and data["shape"]["train_M"] == 16
    (tmp_path / "results.md").unlink()
    assert bench_host.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md


def test_targets_by_hand():
    def data(gl, eager, patched):
        return {"ways": {"gated_linear": {"median_us": gl}, "mlp_eager": {"median_us": eager},
                         "mlp_patched": {"median_us": patched}}}

    assert [v for _, _, v in bench_host.verdicts(data(24.0, 100.0, 75.0))] == ["met", "met"]
    assert [v for _, _, v in bench_host.verdicts(data(26.0, 100.0, 76.0))] == ["missed", "missed"]
    none = {"ways": {"gated_linear": {"skipped": "x"}}}
    assert [v for _, _, v in bench_host.verdicts(none)] == ["n/a", "n/a"]


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X", "--calls", "0"], "expected an integer >= 1, got '0'"),
    (["--dry-run", "--out", "X", "--shape", "gpt-2"], "invalid choice: 'gpt-2'"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench_host.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
