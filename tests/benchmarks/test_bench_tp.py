"""benchmarks/bench_tp.py on CPU: the dry run under torchrun (2 ranks, gloo) loads a tiny Llama
with tp_plan="auto", times every part eager and patched on the one sharded model, and agrees
with eager; bad arguments are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import interpreter_subprocess_env

from benchmarks import bench_tp

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "benchmarks.bench_tp", "--dry-run", "--out", str(tmp_path / "out"), "--rounds", "1",
           "--model-dir", str(tmp_path / "model"), "--commit", "abc123"]
    done = subprocess.run(cmd, cwd=ROOT, env=interpreter_subprocess_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["settings"]["ranks"] == 2 and data["env"]["git"]["commit"] == "abc123"
    assert [(r["kind"], r["size"]) for r in data["rows"]] == [
        ("prefill", 16), ("prefill", 32), ("dynamic", 1), ("dynamic", 2), ("static", 1), ("static", 2)]
    for r in data["rows"]:
        assert "failed" not in r, r
        assert len(r["speedup"]["rounds"]) == 1 and r["eager_per_s"] > 0 and r["patched_per_s"] > 0
        if r["kind"] != "prefill":
            assert r["leading_tokens_equal"] == 4  # fp32, the torch backend: the same greedy tokens
    assert data["agreement"]["rel_logit_diff"] < 1e-5 and data["agreement"]["top1_agree"] == 1.0
    assert "| dynamic | batch 2 |" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X"], "run under torchrun"),
    (["--dry-run", "--out", "X", "--rounds", "0"], "expected an integer >= 1, got '0'"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench_tp.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
