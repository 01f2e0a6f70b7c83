"""FSDP2 (`fully_shard`) on a patched MoE model, 2 processes on CPU with gloo (`fsdp2_moe_worker.py`).

A tiny Qwen3-MoE checkpoint (4 experts, so each rank holds 2 of every experts tensor's rows
along dim 0): the 3-D experts weights shard along dim 0 and are whole inside the experts'
forward, then resharded; two AdamW steps on half a batch per rank give the losses, the first
gradients and the trained weights of the unsharded run on the whole batch (fp32, 1e-5), patched
and unpatched, on the PyTorch path and the Triton kernels (interpreter). The router's auxiliary
loss is left out of the loss here: it is not additive over a split batch (the training-stack
tests check it unsharded).
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
from helpers import rel_err
from training_stack.training_common import token_batches, train, train_backends
from transformers import AutoModelForCausalLM

from swiglu_patch import apply_fused_mlp
from zoo.tiny_zoo import tiny_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp2_moe_worker.py")
BUDGET_S = 300
LR = 1e-2
BATCHES = [b.tolist() for b in token_batches(2, 4, 10, 100)]  # two steps of [4, 10]; each rank takes [2, 10]
LAUNCH_FAILURES = ("RendezvousConnectionError", "RendezvousTimeoutError", "EADDRINUSE", "Address already in use",
                   "Connection refused", "gloo is not available", "No module named torch.distributed.run")
BACKENDS = train_backends()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2_moe_checkpoint")
    config = tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, output_router_logits=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no torch.distributed with the gloo backend; the FSDP2 tests need it")
    out = tmp_path_factory.mktemp("fsdp2_moe")
    backends = [b if isinstance(b, str) else b.values[0] for b in BACKENDS]
    (out / "case.json").write_text(json.dumps(dict(path=str(checkpoint), backends=backends, batches=BATCHES, lr=LR)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(WORKER.parent.parent)] + sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(out / "case.json"), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=BUDGET_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun --nproc-per-node 2 ran past its budget of {BUDGET_S} s; output tail:\n"
                    f"{(e.stderr or b'')[-3000:]!r}")
    log = proc.stdout + proc.stderr
    files = [out / f"rank{r}.pt" for r in range(2)]
    if proc.returncode != 0 and not any(f.exists() for f in files) and any(s in log for s in LAUNCH_FAILURES):
        pytest.skip(f"torchrun could not start 2 gloo processes on this machine: {log[-1500:]}")
    assert proc.returncode == 0 and all(f.exists() for f in files), f"torchrun failed (rc {proc.returncode}):\n" \
                                                                    f"{log[-5000:]}"
    return [torch.load(f, weights_only=False) for f in files]


def recorded(ranks, backend) -> list[dict]:
    for r, res in enumerate(ranks):
        if "exception" in res[backend]:
            pytest.fail(f"rank {r}, backend {backend} raised:\n{res[backend]['exception']}")
    return [res[backend] for res in ranks]


def unsharded(checkpoint, backend: str | None) -> dict:
    """The single-process run on whole batches: losses, first-step gradients, trained state dict."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if backend:
        apply_fused_mlp(model, backend=backend)
    grads = {}

    class FirstGrads(torch.optim.AdamW):
        def step(self, *a, **k):
            if not grads:
                grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(*a, **k)

    losses = train(model, [torch.tensor(b) for b in BATCHES], optimizer=FirstGrads(model.parameters(), lr=LR))
    return dict(losses=losses, grads=grads, state=model.state_dict())


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_weights_shard_along_experts_and_reshard(ranks, backend):
    for rec in recorded(ranks, backend):
        assert rec["experts_fused"] == 2
        kind, placements, local, whole = rec["before"]
        assert kind == "DTensor" and placements == ("Shard(dim=0)",) and local[0] * 2 == whole[0] == 4, rec["before"]
        assert rec["inside"][0] != "DTensor" and rec["inside"][2] == whole, f"not whole in forward: {rec['inside']}"
        assert rec["after"] == rec["before"], "not resharded after forward"


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_gradients_and_weights_equal_the_unsharded_run(ranks, checkpoint, backend):
    recs = recorded(ranks, backend)
    ref, eager = unsharded(checkpoint, backend), unsharded(checkpoint, None)
    for rec in recs:
        for ours, theirs in ((rec["losses"], ref["losses"]), (rec["losses"], eager["losses"])):
            assert all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, theirs)), (ours, theirs)
    grads, state = recs[0]["grads"], recs[0]["state"]
    assert grads.keys() == eager["grads"].keys() and any("experts" in k for k in grads)
    for k in grads:
        assert rel_err(grads[k], eager["grads"][k]) < 1e-5, k
    assert state.keys() == eager["state"].keys()
    for k in state:
        assert rel_err(state[k], eager["state"][k]) < 1e-5, k
