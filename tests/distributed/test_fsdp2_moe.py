"""FSDP2 (`fully_shard`) on a patched MoE model, 2 processes on CPU with gloo (`fsdp2_moe_worker.py`).

A tiny Qwen3-MoE checkpoint (4 experts, so each rank holds 2 of every experts tensor's rows
along dim 0): the 3-D experts weights shard along dim 0 and are whole inside the experts'
forward, then resharded; two AdamW steps on half a batch per rank give the losses, the first
gradients and the trained weights of the unsharded run on the whole batch (fp32, 1e-5), patched
and unpatched, on the PyTorch path and the Triton kernels (interpreter). The router's auxiliary
loss is left out of the loss here: it is not additive over a split batch (the training-stack
tests check it unsharded).

PEFT LoRA on the experts' 3-D weights (`target_parameters`) and on attention, patched then
sharded the same way: the experts' adapters shard along dim 0 (lora_A [E * r, in]), run inside
the fused experts on every forward with PEFT's W + s*B@A never built, and train as plain PEFT on
the unsharded, unpatched model does (losses, first gradients, trained adapters); the experts'
weights stay frozen; the adapters saved from the gathered state dict load into plain
transformers + PEFT and give the sharded model's logits.
"""

from __future__ import annotations

from pathlib import Path

from distributed import fsdp2_common as common, launch
import pytest
import torch
from helpers import rel_err
from peft import LoraConfig, PeftModel, get_peft_model
from training_stack.training_common import cpu_train_backends, token_batches
from transformers import AutoModelForCausalLM

from zoo.tiny_zoo import tiny_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp2_moe_worker.py")
BUDGET_S = 300
LR = 1e-2
BATCHES = [b.tolist() for b in token_batches(2, 4, 10, 100)]  # two steps of [4, 10]; each rank takes [2, 10]
PROBE = token_batches(1, 2, 7, 100, seed=2)[0].tolist()
BACKENDS = cpu_train_backends()
# adapters on the experts and on attention; random B (init_lora_weights=False) so the first
# step's gradients of A are not zero; no dropout: each rank would draw its own masks
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2_moe_checkpoint")
    config = tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, output_router_logits=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp2_moe")


@pytest.fixture(scope="module")
def ranks(checkpoint, out) -> list[dict]:
    """What each rank of one `torchrun --nproc-per-node 2` launch recorded, per backend."""
    backends = [b if isinstance(b, str) else b.values[0] for b in BACKENDS]
    case = dict(path=str(checkpoint), backends=backends, batches=BATCHES, lr=LR, lora=LORA, probe=PROBE)
    return launch.ranks_of(WORKER, case, out, 2, BUDGET_S)


def unsharded(checkpoint, backend: str | None) -> dict:
    return launch.unsharded(checkpoint, backend, BATCHES, LR)


@pytest.fixture(scope="module")
def plain_peft(checkpoint) -> dict:
    """Plain PEFT on the unsharded, unpatched checkpoint, trained on the whole batches (`common.reference`)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)  # the adapters the workers draw
    return common.reference(get_peft_model(model, LoraConfig(**LORA)), BATCHES, LR)


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_weights_shard_along_experts_and_reshard(ranks, backend):
    for rec in common.recorded(ranks, backend):
        assert rec["experts_fused"] == 2
        kind, placements, local, whole = rec["before"]
        assert kind == "DTensor" and placements == ("Shard(dim=0)",) and local[0] * 2 == whole[0] == 4, rec["before"]
        assert rec["inside"][0] != "DTensor" and rec["inside"][2] == whole, f"not whole in forward: {rec['inside']}"
        assert rec["after"] == rec["before"], "not resharded after forward"


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_gradients_and_weights_equal_the_unsharded_run(ranks, checkpoint, backend):
    recs = common.recorded(ranks, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_experts_shards_and_runs_fused(ranks, checkpoint, backend):
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).model.layers[0].mlp.experts
    for rec in common.recorded(ranks, f"lora:{backend}"):
        # lora_A of gate_up_proj: [E * r, K] = [16, 64], 8 rows (2 experts' r) per rank
        assert rec["adapter_layout"] == ("DTensor", ("Shard(dim=0)",), (8, 64), (16, 64)), rec["adapter_layout"]
        # each layer's experts: one forward per training step and one on the probe
        assert rec["fused"] == [True] * 2 * (len(BATCHES) + 1), f"experts forwards without their adapters: {rec['fused']}"
        for name, weight in rec["frozen"].items():
            assert torch.equal(weight, getattr(base, name).detach()), f"the frozen experts' {name} changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_experts_under_fsdp2_trains_as_plain_peft_unsharded(ranks, plain_peft, backend):
    recs = common.recorded(ranks, f"lora:{backend}")
    losses, grads, trained = plain_peft["losses"], plain_peft["grads"], plain_peft["trained"]
    for rec in recs:
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rec["losses"], losses)), (rec["losses"], losses)
    ours = recs[0]
    assert ours["grads"].keys() == grads.keys()
    assert any("experts.lora_A" in k for k in grads) and any("experts.base_layer.lora_B" in k for k in grads)
    assert any("self_attn.q_proj.lora_A" in k for k in grads)
    for k in grads:
        assert rel_err(ours["grads"][k], grads[k]) < 1e-5, k
    for k in trained:
        assert rel_err(ours["trained"][k], trained[k]) < 1e-5, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_saved_under_fsdp2_load_in_plain_peft(ranks, checkpoint, out, backend):
    logits = common.recorded(ranks, f"lora:{backend}")[0]["logits"]
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out / f"adapter_{backend}").eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(PROBE)).logits
    assert rel_err(logits, theirs) < 1e-5
