"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on a patched model, 2 processes on CPU with gloo.

One torchrun launch runs `fsdp2_worker.py` for every backend on a tiny Llama checkpoint (I = 72,
so the packed weight's 144 rows split 72 per rank, through a partial block of 16): the packed
weight shards along dim 0 and reshards after forward; two AdamW steps on half a batch per rank
give the losses and first gradients of the unsharded run on the whole batch (fp32, 1e-5), patched
and unpatched; the full and the sharded state dicts speak the original checkpoint's keys, and
both load back (DCP save/load, and `set_model_state_dict` of the full one). PEFT LoRA on the
patched model, sharded the same way, trains its adapters as plain PEFT on the unsharded,
unpatched model does (losses, first gradients, trained adapters; the packed weight unchanged).
"""

from __future__ import annotations

from pathlib import Path

from distributed import fsdp2_common as common, launch
import pytest
import torch
from helpers import rel_err, tiny_model
from training_stack.training_common import cpu_train_backends, token_batches
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from swiglu_patch.kernels.layout import interleave_gate_up

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp2_worker.py")
BUDGET_S = 180  # measured ~25 s on 2 cores (torch backend)
LR = 1e-2
BATCHES = [b.tolist() for b in token_batches(2, 4, 12, 128)]  # two steps of [4, 12]; each rank takes [2, 12]
BACKENDS = cpu_train_backends()
# adapters on attention and on every MLP projection; random B (init_lora_weights=False) so the
# first step's gradients of A are not zero; no dropout: each rank draws its own masks
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2_checkpoint")
    tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    """What each rank of one `torchrun --nproc-per-node 2` launch recorded, per backend."""
    backends = [b if isinstance(b, str) else b.values[0] for b in BACKENDS]
    return launch.ranks_of(WORKER, dict(path=str(checkpoint), backends=backends, batches=BATCHES, lr=LR, lora=LORA), tmp_path_factory.mktemp("fsdp2"), 2, BUDGET_S)


def unsharded(checkpoint, backend: str | None) -> dict:
    return launch.unsharded(checkpoint, backend, BATCHES, LR)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_weight_shards_along_dim0_and_reshards(ranks, backend):
    for rec in common.recorded(ranks, backend):
        sharded = ("DTensor", ("Shard(dim=0)",), (72, 64), (144, 64))
        assert rec["packed_before"] == sharded, rec["packed_before"]
        kind, placements, local, whole = rec["packed_inside"]
        assert kind != "DTensor" and local == whole == (144, 64), f"not unsharded in forward: {rec['packed_inside']}"
        assert rec["packed_after"] == sharded == rec["packed_trained"], "not resharded after forward"


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_and_gradients_equal_the_unsharded_run(ranks, checkpoint, backend):
    recs = common.recorded(ranks, backend)
    ref, eager = unsharded(checkpoint, backend), unsharded(checkpoint, None)
    for rec in recs:
        for ours, theirs in ((rec["losses"], ref["losses"]), (rec["losses"], eager["losses"])):
            assert all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, theirs)), (ours, theirs)
    grads = recs[0]["grads"]
    assert grads.keys() == ref["grads"].keys()
    for k in grads:
        assert rel_err(grads[k], ref["grads"][k]) < 1e-5, k
    for layer in range(2):  # and the packed gradient is the unpatched model's gate/up gradients, packed
        key = f"model.layers.{layer}.mlp."
        packed = interleave_gate_up(eager["grads"][key + "gate_proj.weight"], eager["grads"][key + "up_proj.weight"])
        assert rel_err(grads[key + "gate_up_interleaved"], packed) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dicts_speak_the_original_keys_and_load_back(ranks, checkpoint, backend):
    recs = common.recorded(ranks, backend)
    eager = unsharded(checkpoint, None)["state"]
    full = recs[0]["full"]
    assert full.keys() == eager.keys()
    for k in eager:  # 1e-4 after AdamW: its g / sqrt(v) magnifies the rounding of near-zero gradient entries
        assert rel_err(full[k], eager[k]) < 1e-4, k
    for rec in recs:
        keys = rec["sharded_keys"]
        assert keys.keys() == eager.keys()
        for name in ("gate_proj", "up_proj"):
            kind, placements, local, whole = keys[f"model.layers.0.mlp.{name}.weight"]
            assert (kind, placements, local, whole) == ("DTensor", ("Shard(dim=0)",), (36, 64), (72, 64))
    for loaded in ("from_dcp", "from_full"):
        assert recs[0][loaded].keys() == full.keys()
        assert all(torch.equal(recs[0][loaded][k], full[k]) for k in full), f"{loaded} differs from what was saved"


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_under_fsdp2_trains_as_plain_peft_unsharded(ranks, checkpoint, backend):
    recs = common.recorded(ranks, f"lora:{backend}")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    ref = get_peft_model(model, LoraConfig(**LORA))
    theirs = common.reference(ref, BATCHES, LR)
    losses, grads, trained = theirs["losses"], theirs["grads"], theirs["trained"]
    for rec in recs:
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rec["losses"], losses)), (rec["losses"], losses)
    ours = recs[0]
    assert ours["grads"].keys() == grads.keys() and any("mlp.gate_proj.lora_A" in k for k in grads)
    for k in grads:
        assert rel_err(ours["grads"][k], grads[k]) < 1e-5, k
    for k in trained:
        assert rel_err(ours["trained"][k], trained[k]) < 1e-4, k
    base = ref.base_model.model.model.layers[0].mlp
    packed = interleave_gate_up(base.gate_proj.base_layer.weight.detach(), base.up_proj.base_layer.weight.detach())
    assert torch.equal(ours["packed"], packed), "the frozen packed weight changed"
