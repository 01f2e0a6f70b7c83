"""`transformers.Trainer` on a patched model: the same per-step losses as on the unpatched one
(fp32, 1e-5), the loss goes down, and the checkpoint it saves is a plain transformers checkpoint
(original gate_proj/up_proj keys) that reloads without swiglu-patch; a PEFT LoRA model trains
and checkpoints its adapter with plain PEFT's keys."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err, tiny_model
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from training_common import assert_losses_close, device_of, token_batches, train_backends
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from swiglu_patch import apply_fused_mlp

STEPS = 8


def dataset(n=16, seq=12, vocab=128):
    """n examples of random token ids (the labels are the inputs: causal-LM loss)."""
    ids = torch.cat(token_batches(1, n, seq, vocab))
    return [{"input_ids": row, "labels": row} for row in ids]


def run_trainer(model, out, device: str = "cpu", **overrides) -> tuple[list[float], Trainer]:
    args = TrainingArguments(**(dict(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=device == "cpu", seed=0,
        dataloader_num_workers=0, disable_tqdm=True) | overrides))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


@pytest.mark.parametrize("backend", train_backends())
def test_trainer_matches_unpatched_and_checkpoints_plain_keys(backend, tmp_path):
    device = device_of(backend)
    base = tiny_model("llama", device=device)
    ref_losses, _ = run_trainer(copy.deepcopy(base), tmp_path / "ref", device)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    losses, trainer = run_trainer(model, tmp_path / "ours", device, save_strategy="steps", save_steps=STEPS)
    assert len(losses) == STEPS and losses[-1] < 0.9 * losses[0], f"the loss did not go down: {losses}"
    assert_losses_close(losses, ref_losses, 1e-5, "Trainer, patched vs unpatched")

    checkpoint = tmp_path / "ours" / f"checkpoint-{STEPS}"
    saved = load_file(checkpoint / "model.safetensors")
    assert saved.keys() == set(base.state_dict()) - {"lm_head.weight"} or saved.keys() == set(base.state_dict())
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint).to(device).eval()
    ids = token_batches(1, 2, 9, 128)[0].to(device)
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, trainer.model.eval()(ids).logits) < 1e-6


def test_trainer_trains_lora_on_patched_model(tmp_path):
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    base = tiny_model("llama")
    torch.manual_seed(0)  # PEFT draws lora_A from the global RNG, in module order (the same in both)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    ref_losses, _ = run_trainer(ref, tmp_path / "ref", learning_rate=2e-2, save_strategy="steps", save_steps=STEPS)
    patched = copy.deepcopy(base)
    apply_fused_mlp(patched, backend="torch")
    torch.manual_seed(0)
    ours = get_peft_model(patched, LoraConfig(**config))
    losses, _ = run_trainer(ours, tmp_path / "ours", learning_rate=2e-2, save_strategy="steps", save_steps=STEPS)
    assert losses[-1] < losses[0], losses
    assert_losses_close(losses, ref_losses, 1e-5, "Trainer + LoRA, patched vs unpatched")
    ref_saved, saved = (load_file(tmp_path / d / f"checkpoint-{STEPS}" / "adapter_model.safetensors")
                        for d in ("ref", "ours"))
    assert saved.keys() == ref_saved.keys()
    assert all(rel_err(saved[k], ref_saved[k]) < 1e-5 for k in saved if ref_saved[k].abs().sum() > 0)
