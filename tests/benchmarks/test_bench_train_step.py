"""benchmarks/bench_train_step.py on CPU: the dry run trains every way (eager, store, recompute;
Liger is recorded as skipped without a GPU) with and without gradient checkpointing, the losses
of every step match eager's, FSDP2 runs under torchrun with gloo, and bad arguments are
one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import interpreter_subprocess_env

from benchmarks import bench_train_step

FAST = ["--rounds", "1", "--warmup", "1", "--steps", "2"]
ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_trains_every_way_to_eager_losses(tmp_path):
    assert bench_train_step.main(["--dry-run", "--out", str(tmp_path), "--commit", "abc123", *FAST]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["kind"] == "bench_train_step" and data["env"]["git"]["commit"] == "abc123"
    assert "liger" in data["skipped"]
    keys = set(data["results"])
    assert keys == {"eager", "store", "recompute", "eager +ckpt", "store +ckpt", "recompute +ckpt"}
    eager = data["results"]["eager"]["losses"]
    assert len(eager) == 3 and len(set(eager)) == 3  # three different batches
    for e in data["results"].values():
        assert e["losses_within_tolerance"] and e["max_loss_diff"] < 1e-5  # fp32: the same math
        assert e["tokens_per_s"] > 0 and len(e["rounds_step_s"]) == 1
    md = (tmp_path / "results.md").read_text()
    assert "| recompute | on |" in md and "liger: not run" in md
    (tmp_path / "results.md").unlink()
    assert bench_train_step.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md
    assert all(e["clock"] is None for e in data["results"].values()) and "GPU while" not in md  # CPU: no samples
    clock = {"samples": 9, "sm_mhz_median": 1365.0, "sm_mhz_max": 1980.0, "power_w_median": 698.0,
             "power_limit_w": 700.0, "power_capped_share": 1.0}
    data["results"]["store"]["clock"] = clock
    assert "- store SM clock 1365 MHz (median; 1980 max), board power 698 W of its 700 W limit, at the power cap in " \
           "100% of 9 samples" in bench_train_step.render_markdown(data)


def test_fsdp2_dry_run_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "benchmarks.bench_train_step", "--fsdp2", "--dry-run", "--out", str(tmp_path), "--checkpointing", "off",
           *FAST]
    env = interpreter_subprocess_env(OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["ranks"] == 2 and data["settings"]["fsdp2"]
    assert set(data["results"]) == {"eager", "store", "recompute"}
    for e in data["results"].values():
        assert len(e["peak_mib_per_rank"]) == 2 and e["losses_within_tolerance"] and e["max_loss_diff"] < 1e-5


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X", "--steps", "0"], "expected an integer >= 1, got '0'"),
    (["--dry-run", "--out", "X", "--ways", "unsloth"], "invalid choice: 'unsloth'"),
    (["--dry-run", "--out", "X", "--fsdp2"], "--fsdp2 runs under torchrun"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench_train_step.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_dry_run_with_lora_trains_the_adapters_to_eager_losses(tmp_path):
    """--lora: PEFT adapters on every projection, patched through swiglu_patch.lora.register."""
    argv = ["--dry-run", "--out", str(tmp_path), "--lora", "4", "--ways", "eager", "store", "--checkpointing", "off",
            *FAST]
    assert bench_train_step.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["lora_rank"] == 4 and set(data["results"]) == {"eager", "store"}
    store = data["results"]["store"]
    assert store["losses_within_tolerance"] and store["max_loss_diff"] < 1e-4
    assert "PEFT LoRA r=4" in (tmp_path / "results.md").read_text()
