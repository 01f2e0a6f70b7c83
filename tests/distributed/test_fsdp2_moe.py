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

from pathlib import Path

from distributed import launch
import pytest
import torch
from helpers import rel_err
from training_stack.training_common import token_batches, train_backends
from transformers import AutoModelForCausalLM

from zoo.tiny_zoo import tiny_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp2_moe_worker.py")
BUDGET_S = 300
LR = 1e-2
BATCHES = [b.tolist() for b in token_batches(2, 4, 10, 100)]  # two steps of [4, 10]; each rank takes [2, 10]
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
    """What each rank of one `torchrun --nproc-per-node 2` launch recorded, per backend."""
    backends = [b if isinstance(b, str) else b.values[0] for b in BACKENDS]
    return launch.ranks_of(WORKER, dict(path=str(checkpoint), backends=backends, batches=BATCHES, lr=LR), tmp_path_factory.mktemp("fsdp2_moe"), 2, BUDGET_S)


def recorded(ranks, backend) -> list[dict]:
    for r, res in enumerate(ranks):
        if "exception" in res[backend]:
            pytest.fail(f"rank {r}, backend {backend} raised:\n{res[backend]['exception']}")
    return [res[backend] for res in ranks]


def unsharded(checkpoint, backend: str | None) -> dict:
    return launch.unsharded(checkpoint, backend, BATCHES, LR)


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
