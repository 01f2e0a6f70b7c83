"""Shared pieces of the training-stack tests: the backends to train through, data, a train loop.

`train_backends()` lists "torch" (the differentiable PyTorch reference) and "triton" (the
registered op with its backward, `swiglu_patch.training`; LoRA adapters ride in its GEMMs). On
CPU the Triton kernels run under TRITON_INTERPRET=1, in fp32; on a GPU machine a test runs
"triton" on CUDA (`device_of`), and "torch" on CPU as there.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, cpu_triton_refusal


def gpu_kernels() -> bool:
    """Whether this process runs the compiled kernels on a CUDA GPU (not Triton's interpreter)."""
    from swiglu_patch.kernels.device import interpreting

    return CUDA and not interpreting()


def train_backends() -> list:
    """pytest params for the backend a training test runs: "torch", and "triton": on a GPU machine the
    compiled kernels, the test's models on CUDA (`device_of`); on CPU the interpreter (slow), skipped
    where it cannot run the kernels (`helpers.cpu_triton_refusal`)."""
    return ["torch", "triton"] if gpu_kernels() else cpu_train_backends()


def cpu_train_backends() -> list:
    """`train_backends` for tests whose models stay on CPU in this process (the gloo tests' references):
    "triton" skipped where this process cannot run it on CPU tensors (on a GPU machine, for one)."""
    refusal = cpu_triton_refusal()
    if refusal:
        return ["torch", pytest.param("triton", marks=pytest.mark.skip(reason=refusal))]
    return ["torch", pytest.param("triton", marks=pytest.mark.slow)]


def device_of(backend: str) -> str:
    """Where a training test runs `backend`: CUDA for "triton" on a GPU machine, else CPU."""
    return "cuda" if backend == "triton" and gpu_kernels() else "cpu"


def token_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    """`steps` random [batch, seq] int64 batches of token ids in [3, vocab) (past the special ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def train(model, batches, lr: float = 1e-2, seed: int = 0, optimizer=None) -> list[float]:
    """Plain loop: AdamW (unless given), causal-LM loss on each batch (moved to the model's device);
    the per-step losses.

    The global RNG is reseeded first so dropout draws the same masks in two models that call
    their random ops in the same order.
    """
    torch.manual_seed(seed)
    model.train()
    opt = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    device = next(model.parameters()).device
    losses = []
    for ids in batches:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_losses_close(ours: list[float], ref: list[float], rtol: float, what: str) -> None:
    """Every step's loss within rtol of the reference's (relative)."""
    assert len(ours) == len(ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    assert worst <= rtol, f"{what}: worst relative loss difference {worst:.3g} > {rtol:g}\nours {ours}\nref  {ref}"
