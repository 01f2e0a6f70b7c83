"""How the harness turns the loaded (eager) model into the fused one and back.

The harness loads the model once, runs eager, patches in place, runs fused: one load halves
the time and memory of two, and both runs see the very same weights (`unpatch` restores
them bit for bit, so a check-patch-unpatch before the eager run changes nothing).

A `Patcher` is the seam: the default uses swiglu-patch's public API; tests subclass it to
compare a model with itself (`IdentityPatcher`) or with a deliberately broken copy.
"""

from __future__ import annotations

import os

import torch

from .errors import EvalSetupError


class Patcher:
    """Apply and undo swiglu-patch's fused MLP (public API only).

    Args:
        backend: `apply_fused_mlp` backend: "auto" (Triton on CUDA, PyTorch reference
            elsewhere), "triton" (CPU only under TRITON_INTERPRET=1) or "torch".
        strict: refuse models with any gated MLP that cannot be patched.
    """

    name = "fused"

    def __init__(self, backend: str = "auto", strict: bool = True):
        self.backend = backend
        self.strict = strict
        self.last_report = None

    def check(self, model: torch.nn.Module) -> str:
        """Patch and unpatch once, so an unpatchable model fails before any evaluation.

        Returns:
            The patch report as text.

        Raises:
            EvalSetupError: the model cannot be patched (the reason from `apply_fused_mlp`).
        """
        from swiglu_patch import PatchError

        try:
            text = self.apply(model)
        except (PatchError, ValueError, RuntimeError, ImportError) as err:
            raise EvalSetupError(f"the model cannot be patched, nothing was evaluated: {err}") from err
        self.restore(model)
        return text

    def apply(self, model: torch.nn.Module) -> str:
        """Patch `model` in place; returns `str(report)`."""
        from swiglu_patch import apply_fused_mlp

        self.last_report = apply_fused_mlp(model, strict=self.strict, backend=self.backend)
        return str(self.last_report)

    def restore(self, model: torch.nn.Module) -> None:
        """Undo `apply`: the original modules and weights, bit for bit."""
        from swiglu_patch import unpatch

        unpatch(model)

    def path(self, model: torch.nn.Module) -> str:
        """Which computation the fused modules run on this model's device, in words."""
        device = next(model.parameters()).device
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if self.backend == "torch" or (self.backend == "auto" and device.type != "cuda"):
            return f"PyTorch reference of the packed layout (backend={self.backend!r}, {device.type})"
        if device.type == "cuda":
            return f"Triton kernel (backend={self.backend!r}, {torch.cuda.get_device_name(device)})"
        return f"Triton kernel under TRITON_INTERPRET={'1' if interp else '0'} (backend={self.backend!r}, cpu)"


class IdentityPatcher(Patcher):
    """Leaves the model as it is: eager compared with eager, the harness's zero point."""

    name = "identity"

    def check(self, model: torch.nn.Module) -> str:
        return "identity: model left unpatched (eager vs eager)"

    def apply(self, model: torch.nn.Module) -> str:
        return "identity: model left unpatched (eager vs eager)"

    def restore(self, model: torch.nn.Module) -> None:
        return None

    def path(self, model: torch.nn.Module) -> str:
        return "eager (identity patcher)"


def load_model(model: str, dtype: str = "auto", device: str | None = None, gguf_file: str | None = None):
    """Load a causal LM and its tokenizer from a local path or hub id, for evaluation.

    Args:
        model: local directory or hub id.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        device: "cpu", "cuda", "cuda:1", ...; default cuda when available.
        gguf_file: file name inside `model` for a GGUF checkpoint (needs the gguf package).

    Returns:
        (model in eval mode on `device`, tokenizer).

    Raises:
        EvalSetupError: unknown dtype, or transformers cannot load the model/tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise EvalSetupError(f"--dtype must be one of {list(dtypes)}, got {dtype!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(model, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtypes[dtype], **kwargs)
    except (OSError, ValueError, ImportError) as err:
        raise EvalSetupError(
            f"cannot load model {model!r}: {err}. Give a local checkpoint folder, or a hub id with the hub reachable."
        ) from err
    if dtype != "auto" and lm.dtype != dtypes[dtype]:
        lm = lm.to(dtypes[dtype])  # GGUF loads dequantize to float32 whatever dtype says
    return lm.to(device).eval(), tok


def model_summary(model: torch.nn.Module) -> dict:
    """{class, model_type, dtype, device, parameters} of a loaded model, for the report."""
    p = next(model.parameters())
    return {
        "class": type(model).__name__,
        "model_type": getattr(getattr(model, "config", None), "model_type", None),
        "dtype": str(p.dtype).replace("torch.", ""),
        "device": str(p.device),
        "parameters": sum(x.numel() for x in model.parameters()),
    }
