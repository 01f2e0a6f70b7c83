"""The training stack around the fused experts, on a tiny Qwen3-MoE (fp32, CPU): HF `Trainer`,
gradient checkpointing and `torch.compile` of a whole step give the unpatched model's losses
(1e-5 relative, the router's auxiliary loss in them: `output_router_logits=True`), and the
Trainer's checkpoint is a plain transformers checkpoint. The experts train through the
registered op and its backward on the Triton backend (the interpreter on CPU) and through the
differentiable reference on the PyTorch one. FSDP2 is tests/distributed/test_fsdp2_moe.py's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err
from training_common import assert_losses_close, device_of, token_batches, train_backends
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from swiglu_patch import apply_fused_mlp
from zoo.tiny_zoo import tiny_config

STEPS = 4


def tiny_moe(device: str = "cpu", **overrides):
    """A tiny random Qwen3-MoE (the zoo's config, `overrides` on it) whose loss includes the router's
    auxiliary loss (coefficient 0.1: large enough that a wrong router gradient shows in the loss)."""
    config = tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.1, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()


def patched(model, backend):
    model = copy.deepcopy(model)
    report = apply_fused_mlp(model, backend=backend)
    assert len(report.experts) == model.config.num_hidden_layers, report
    return model


def train_with_aux(model, batches, lr=1e-2) -> list[tuple[float, float]]:
    """AdamW steps; (loss, router aux loss) per step."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for ids in batches:
        ids = ids.to(model.device)
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((result.loss.item(), result.aux_loss.item()))
    return out


def _close(ours, ref, what):
    assert_losses_close([a for a, _ in ours], [a for a, _ in ref], 1e-5, what + " (loss)")
    assert_losses_close([b for _, b in ours], [b for _, b in ref], 1e-5, what + " (router aux loss)")


@pytest.mark.parametrize("backend", train_backends())
def test_trainer_trains_a_patched_moe_as_unpatched_and_saves_plain(backend, tmp_path):
    device = device_of(backend)
    base = tiny_moe(device)
    rows = torch.cat(token_batches(1, 16, 10, 100))
    data = [{"input_ids": r, "labels": r} for r in rows]

    def run(model, out, **extra):
        args = TrainingArguments(**(dict(
            output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=5e-3,
            lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0,
            dataloader_num_workers=0, disable_tqdm=True, save_strategy="no") | extra))
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    ref, _ = run(copy.deepcopy(base), tmp_path / "ref")
    ours, trainer = run(patched(base, backend), tmp_path / "ours", save_strategy="steps", save_steps=STEPS)
    assert_losses_close(ours, ref, 1e-5, "Trainer on a patched MoE vs unpatched")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / f"checkpoint-{STEPS}").to(device).eval()
    ids = token_batches(1, 2, 9, 100)[0].to(device)
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, trainer.model.eval()(ids).logits) < 1e-6


@pytest.mark.parametrize("backend", train_backends())
def test_gradient_checkpointing_trains_as_without(backend):
    base = tiny_moe(device_of(backend))
    batches = token_batches(3, 2, 10, 100)
    ref = train_with_aux(copy.deepcopy(base), batches)
    model = patched(base, backend)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    _close(train_with_aux(model, batches), ref, "gradient checkpointing, patched vs unpatched")


@pytest.mark.slow
@pytest.mark.parametrize("backend", train_backends())
def test_compiled_training_step_matches_eager(backend):
    """Forward, backward and AdamW step under one `torch.compile` (one layer: Inductor on 2 CPU cores is slow)."""
    torch._dynamo.reset()
    base = tiny_moe(device_of(backend), num_hidden_layers=1)
    batches = token_batches(3, 2, 10, 100)

    def run(model, compiled):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(ids):
            result = model(input_ids=ids, labels=ids)
            result.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return result.loss.detach()

        fn = torch.compile(step) if compiled else step
        return [fn(ids.to(model.device)).item() for ids in batches]

    ref = run(copy.deepcopy(base), compiled=False)
    assert_losses_close(run(patched(base, backend), compiled=True), ref, 1e-5, "compiled patched MoE step vs eager")
