"""PEFT in either order with the user's own LoraConfig, as a new user writes it: no
`swiglu_patch.lora.register`, no `adapters_aside`.

    apply_fused_mlp(model); model = get_peft_model(model, LoraConfig(...))     # patch, then LoRA
    model = get_peft_model(model, LoraConfig(...)); apply_fused_mlp(model)     # LoRA, then patch

Both train as plain PEFT on the unpatched model: per-step losses to 1e-5 (relative) and every
adapter gradient to 1e-4, with the base weights fused and frozen and the adapters trainable under
PEFT's names; TRL's SFTTrainer takes a patched model with `peft_config=` and trains as it trains
the unpatched one. Tiny Llama, fp32, CPU; the "triton" backend runs the kernels under the
interpreter (slow), or compiled on CUDA on a GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err, tiny_model
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from training_common import device_of, token_batches, train_backends

from swiglu_patch import apply_fused_mlp
from swiglu_patch.lora import PackedLoraLinear
from swiglu_patch.module import FusedGatedMLP

ORDERS = ["patch_then_peft", "peft_then_patch"]
TARGETS = ["gate_proj", "up_proj", "down_proj"]


def user_config() -> LoraConfig:
    """A plain LoraConfig on the MLP projections (PEFT's defaults otherwise: B starts at zero)."""
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=list(TARGETS))


def both_orders(order: str, backend: str):
    """(plain PEFT on the unpatched model, the same adapters on a patched copy in `order`), on
    `backend`'s device (`training_common.device_of`)."""
    base = tiny_model("llama", device=device_of(backend))
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), user_config())
    ours = copy.deepcopy(base)
    if order == "patch_then_peft":
        apply_fused_mlp(ours, backend=backend)
        torch.manual_seed(0)
        ours = get_peft_model(ours, user_config())
    else:
        torch.manual_seed(0)
        ours = get_peft_model(ours, user_config())
        apply_fused_mlp(ours, backend=backend)
    return ref, ours


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("order", ORDERS)
def test_either_order_trains_as_plain_peft(order, backend):
    ref, ours = both_orders(order, backend)
    for layer in ours.base_model.model.model.layers:
        assert isinstance(layer.mlp, FusedGatedMLP), f"{order}: the MLP was not fused"
        assert type(layer.mlp.gate_proj) is PackedLoraLinear and type(layer.mlp.up_proj) is PackedLoraLinear
        assert not layer.mlp.gate_up_interleaved.requires_grad, "the fused base weight must stay frozen"
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in ref.named_parameters() if p.requires_grad}, "not PEFT's trainable names"
    assert get_peft_model_state_dict(ours).keys() == get_peft_model_state_dict(ref).keys()

    ref.train(), ours.train()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, ours)]
    for step, ids in enumerate(token_batches(4, 2, 12, 128)):
        ids = ids.to(device_of(backend))
        losses = []
        for model, opt in zip((ref, ours), opts):
            torch.manual_seed(step)  # the same dropout masks (drawn in the same order: gate, up, down)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0]), (order, step, losses)
        ref_grads, our_grads = grads(ref), grads(ours)
        for name, g in ref_grads.items():
            if g.norm() == 0:  # lora_A at the first step: B is still zero
                assert our_grads[name].norm() == 0, (step, name)
            else:
                assert rel_err(our_grads[name], g) < 1e-4, (step, name, rel_err(our_grads[name], g))
        assert any(g.norm() > 0 for name, g in our_grads.items() if "lora_A" in name) or step == 0
        for opt in opts:
            opt.step()
            opt.zero_grad()


def word_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over the tiny models' ids ("t3" .. "t127"; pad 0, bos 1, eos 2), built offline."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_sft_trainer_takes_a_patched_model_and_a_plain_lora_config(tmp_path):
    """TRL calls get_peft_model itself: a patched model with peft_config= trains as the unpatched one (fp32)."""
    trl = pytest.importorskip("trl", reason="TRL's SFTTrainer (pip install trl)")
    from datasets import Dataset

    rows = torch.cat(token_batches(1, 16, 12, 128))
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})

    def run(model, out):
        args = trl.SFTConfig(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=2e-2,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer(),
                                 peft_config=user_config())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    base = tiny_model("llama")
    ref_losses, _ = run(copy.deepcopy(base), tmp_path / "ref")
    patched = copy.deepcopy(base)
    apply_fused_mlp(patched, backend="torch")
    losses, trainer = run(patched, tmp_path / "ours")
    mlp = trainer.model.base_model.model.model.layers[0].mlp
    assert isinstance(mlp, FusedGatedMLP) and type(mlp.gate_proj) is PackedLoraLinear
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)


@pytest.mark.parametrize("order", ORDERS)
def test_all_linear_targets_what_plain_peft_targets(order):
    """target_modules="all-linear" lists nn.Linear layers; on a patched model the packed gate/up are
    listed too, so the adapters sit where plain PEFT puts them."""
    base = tiny_model("llama")
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules="all-linear"))
    ours = copy.deepcopy(base)
    if order == "patch_then_peft":
        apply_fused_mlp(ours, backend="torch")
        torch.manual_seed(0)
        ours = get_peft_model(ours, LoraConfig(target_modules="all-linear"))
    else:
        torch.manual_seed(0)
        ours = get_peft_model(ours, LoraConfig(target_modules="all-linear"))
        apply_fused_mlp(ours, backend="torch")
    assert set(ours.peft_config["default"].target_modules) == set(ref.peft_config["default"].target_modules)
    state, ref_state = get_peft_model_state_dict(ours), get_peft_model_state_dict(ref)
    assert state.keys() == ref_state.keys() and any("gate_proj" in k for k in state)
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    assert type(ours.base_model.model.model.layers[0].mlp.up_proj) is PackedLoraLinear
