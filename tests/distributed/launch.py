"""Shared by the torchrun tests: launch a worker on N gloo ranks (CPU) and load what each rank recorded,
and the single-process training run the FSDP2 tests compare against.

`ranks_of(worker, case, out, ranks, budget_s)` writes CASE to OUT/case.json, runs ``torchrun
--standalone --nproc-per-node RANKS WORKER OUT/case.json OUT`` (the Triton interpreter, offline,
no GPU), and returns each rank's ``OUT/rank{r}.pt``. It skips where torchrun cannot start gloo
processes on this machine, and fails with the output's tail on any other failure or past the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import interpreter_subprocess_env
from transformers import AutoModelForCausalLM

from swiglu_patch import apply_fused_mlp

LAUNCH_FAILURES = ("RendezvousConnectionError", "RendezvousTimeoutError", "EADDRINUSE", "Address already in use",
                   "Connection refused", "gloo is not available", "No module named torch.distributed.run")


def ranks_of(worker: Path, case: dict, out: Path, ranks: int, budget_s: int) -> list[dict]:
    """Each rank's record of one torchrun launch of `worker` on `case` (see the module docstring)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no torch.distributed with the gloo backend; the torchrun tests need it")
    (out / "case.json").write_text(json.dumps(case))
    env = interpreter_subprocess_env("triton" in case["backends"],
                                     PYTHONPATH=os.pathsep.join([str(worker.parent.parent)] + sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(worker),
           str(out / "case.json"), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun --nproc-per-node {ranks} ran past its budget of {budget_s} s; output tail:\n"
                    f"{(e.stderr or b'')[-3000:]!r}")
    log = proc.stdout + proc.stderr
    files = [out / f"rank{r}.pt" for r in range(ranks)]
    if proc.returncode != 0 and not any(f.exists() for f in files) and any(s in log for s in LAUNCH_FAILURES):
        pytest.skip(f"torchrun could not start {ranks} gloo processes on this machine: {log[-1500:]}")
    assert proc.returncode == 0 and all(f.exists() for f in files), f"torchrun failed (rc {proc.returncode}):\n" \
                                                                    f"{log[-5000:]}"
    return [torch.load(f, weights_only=False) for f in files]


def unsharded(checkpoint, backend: str | None, batches: list, lr: float) -> dict:
    """The single-process run on whole batches (AdamW, `training_common.train`): losses, the first
    step's gradients and the trained state dict; patched with `backend`, or unpatched for None."""
    from training_stack.training_common import train

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if backend:
        apply_fused_mlp(model, backend=backend)
    grads = {}

    class FirstGrads(torch.optim.AdamW):
        def step(self, *a, **k):
            if not grads:
                grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(*a, **k)

    losses = train(model, [torch.tensor(b) for b in batches], optimizer=FirstGrads(model.parameters(), lr=lr))
    return dict(losses=losses, grads=grads, state=model.state_dict())
