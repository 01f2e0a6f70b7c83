"""benchmarks/bench_moe_parallel.py on CPU: the dry run under torchrun (2 ranks, gloo) loads a
tiny Qwen3-MoE under transformers' TP plan and its expert-parallel plan, fuses every experts
module, agrees with the one-process model, and times every part default and patched; bad
arguments are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import interpreter_subprocess_env

from benchmarks import bench_moe_parallel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "benchmarks.bench_moe_parallel", "--dry-run", "--out", str(tmp_path / "out"), "--rounds", "2",
           "--model-dir", str(tmp_path / "model"), "--commit", "abc123"]
    done = subprocess.run(cmd, cwd=ROOT, env=interpreter_subprocess_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["settings"]["ranks"] == 2 and data["env"]["git"]["commit"] == "abc123"
    assert list(data["plans"]) == ["tp", "ep"]
    tp, ep = data["plans"]["tp"], data["plans"]["ep"]
    # TP splits every expert's columns; EP gives each rank whole experts, half of them
    assert tp["layout"]["experts_gate_up"]["local_shape"][0] == data["model"]["num_experts"]
    assert ep["layout"]["experts_gate_up"]["local_shape"][0] == data["model"]["num_experts"] // 2
    assert ep["layout"]["experts_gate_up"]["placements"] == ["Shard(dim=0)"]
    for plan in (tp, ep):
        assert "failed" not in plan, plan["failed"]
        # counted on the call that fused them (round 1 starts patched: a second call would list none)
        assert plan["experts_fused"] == data["model"]["layers"] and plan["experts_not_fused"] == 0
        assert plan["rounds_timed"] == 2
        a = plan["agreement"]
        assert a["layers"] == 1 and a["agrees"]
        assert a["plan_patched_vs_one_gpu"]["rel"] < 1e-5 and a["plan_patched_vs_one_gpu"]["top1"] == 1.0  # fp32
        assert [(r["kind"], r["size"]) for r in plan["rows"]] == [("prefill", 16), ("dynamic", 1), ("dynamic", 2)]
        for r in plan["rows"]:
            assert len(r["speedup"]["rounds"]) == 2 and r["eager_per_s"] > 0 and r["patched_per_s"] > 0
            if r["kind"] != "prefill":
                assert r["leading_tokens_equal"] == 4  # fp32, the torch backend: the same greedy tokens
    text = (tmp_path / "out" / "results.md").read_text()
    assert "## EP: `DistributedConfig(" in text and "| dynamic | batch 2 |" in text and "agrees" in text
    # a plan that failed renders its error and what it measured before
    data["plans"]["ep"] = {"config": ep["config"], "agreement": ep["agreement"], "failed": "RuntimeError: boom"}
    data["notes"] = ["Added after the run: a note."]
    (tmp_path / "failed.json").write_text(json.dumps(data))
    assert bench_moe_parallel.main(["--render", str(tmp_path / "failed.json"), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "results.md").read_text()
    assert "- failed: RuntimeError: boom" in text and text.count("agrees (bound") == 2
    assert text.endswith("Notes:\n\n- Added after the run: a note.\n")


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X"], "run under torchrun"),
    (["--dry-run", "--out", "X", "--plans", "dp"], "invalid choice: 'dp'"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench_moe_parallel.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_check_layers_beyond_layers_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        bench_moe_parallel.main(["--dry-run", "--out", "X", "--layers", "2", "--check-layers", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--check-layers must be between 0 and --layers (2), got 3" in err
