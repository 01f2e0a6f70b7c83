"""The planted defects on the Triton kernels (TRITON_INTERPRET=1 on CPU, the real kernels on CUDA):
each moves the clean Triton run's logits as the same defect moves the PyTorch path's, and
the defect with no kernel form is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from swiglu_patch import FusedGatedMLP, is_patched
from swiglu_patch.evals.defects import DEFECTS, KERNEL_LESS, DefectPatcher
from swiglu_patch.evals.patching import Patcher

KERNEL_DEFECTS = [d for d in DEFECTS if d not in KERNEL_LESS]
# fp16 logits of the tiny model are rounded to 2^-7 (~0.008): the 1% gate errors and the other GELU
# move them less than that, so fp16 runs the defects that move them by ~1 logit
CASES = [(d, torch.float32) for d in KERNEL_DEFECTS] + [(d, torch.float16) for d in ("swap_gate_up", "zero_16", "zero_1")]


def _logits(model, patcher, ids):
    patcher.apply(model)
    try:
        assert {m.backend for m in model.modules() if isinstance(m, FusedGatedMLP)} == {patcher.backend}
        with torch.no_grad():
            return model(input_ids=ids).logits.double()
    finally:
        patcher.restore(model)


@pytest.fixture(scope="module")
def gemma(request):
    """A tiny Gemma 3 (gelu_tanh: every defect applies), fp32 and fp16, and its clean runs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for dtype in (torch.float32, torch.float16):
        model = tiny_model("gemma3_text", dtype=dtype, device=device)
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
        clean = {b: _logits(model, Patcher(backend=b), ids) for b in ("torch", "triton")}
        out[dtype] = (model, ids, clean)
    return out


@pytest.mark.parametrize(("defect", "dtype"), CASES, ids=[f"{d}-{str(t)[6:]}" for d, t in CASES])
def test_kernel_defect_moves_the_logits_as_on_the_pytorch_path(gemma, defect, dtype):
    model, ids, clean = gemma[dtype]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = {b: _logits(model, DefectPatcher(defect, backend=b), ids) - clean[b] for b in ("torch", "triton")}
    assert not is_patched(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    size = moved["torch"].abs().max().item()
    # the two backends round differently (fp32: ~3e-6 of the logits, fp16: one step of 2^-7); the
    # defects' moves are 30x that and more (fp32: 9e-4 for the other GELU to 4 for swapped gate and
    # up), and the two moves agree to within the rounding
    rounding = {torch.float32: 1e-5, torch.float16: 2e-2}[dtype]
    assert size > 30 * rounding, (defect, size)
    err = (moved["triton"] - moved["torch"]).abs().max().item()
    assert err <= rounding + 0.02 * size, (defect, err, size)


def test_a_clean_triton_run_is_not_moved(gemma):
    """The zero point of the test above: the two clean runs differ by rounding only (and differ:
    the kernel ran, not the PyTorch path)."""
    _, _, clean = gemma[torch.float32]
    assert 0 < (clean["triton"] - clean["torch"]).abs().max() < 1e-5


def test_preact_rounding_has_no_kernel_form():
    with pytest.raises(ValueError, match="preact_e4m3 has no Triton kernel form.*backend='torch'"):
        DefectPatcher("preact_e4m3", backend="triton")
    with pytest.raises(ValueError, match="backend must be 'torch', 'triton' or 'auto', got 'cuda'"):
        DefectPatcher("zero_1", backend="cuda")
    model, patcher = tiny_model("gemma3_text"), DefectPatcher("preact_e4m3", backend="auto")
    assert "planted" in patcher.apply(model)  # auto on CPU: the PyTorch path, where it lives
    patcher.restore(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="backend 'auto' runs the Triton kernels only on CUDA")
def test_preact_rounding_refused_under_auto_on_cuda():
    model = tiny_model("gemma3_text", device="cuda")
    with pytest.raises(ValueError, match="no Triton kernel form.*'auto' runs the Triton kernels on CUDA"):
        DefectPatcher("preact_e4m3", backend="auto").apply(model)
    assert not is_patched(model)
