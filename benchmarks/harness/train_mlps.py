"""The MLP modules `bench_train` trains (forward + backward of one gated MLP), all on the same
weights: x [M, K] -> y [M, K] in the weights' dtype.

- `eager_module`: transformers' own class, `LlamaMLP` (silu) or `Gemma2MLP`
  (gelu_pytorch_tanh), random init; gate_proj, up_proj [I, K], down_proj [K, I], no biases.
- `ours_module`: `swiglu_patch.training.gated_mlp` on the eager module's weights, gate and up
  interleaved into one [2I, K] parameter, in "store" (P [M, 2I] saved) or "recompute" mode.
- `liger_modules`: Liger-Kernel's MLP classes for the activation, loaded with the eager
  module's state dict (`LigerSwiGLUMLP` and `LigerMLP` for silu, `LigerGEGLUMLP` otherwise);
  LigerMLP takes [B, S, K] only and runs on x as [1, M, K] (`Batched`).
- `gemm_floor_module`: not an MLP. The six GEMMs of a gated MLP's forward + backward alone, at
  cuBLAS's speed, with no activation, derivative or other elementwise op: the time any design
  built on cuBLAS-speed GEMMs cannot go below. Its gradients are not the MLP's.

transformers, swiglu_patch and Liger are imported only when a module is built, never at import.
"""

from __future__ import annotations

import importlib

import torch


def eager_module(act: str, k: int, i: int, device, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """(HF's MLP of hidden size k and intermediate size i, its config): LlamaMLP for act "silu",
    else Gemma2MLP (gelu_pytorch_tanh); random init, on device in dtype."""
    with torch.device(device):
        if act == "silu":
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaMLP

            config = LlamaConfig(hidden_size=k, intermediate_size=i, hidden_act="silu")
            return LlamaMLP(config).to(dtype), config
        from transformers import Gemma2Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

        config = Gemma2Config(hidden_size=k, intermediate_size=i, hidden_activation="gelu_pytorch_tanh")
        return Gemma2MLP(config).to(dtype), config


def ours_module(eager: torch.nn.Module, act: str, mode: str) -> torch.nn.Module:
    """`gated_mlp` with act in mode ("store" or "recompute") on copies of eager's weights:
    `gate_up_interleaved` [2I, K] (gate and up rows interleaved) and `down` [K, I]."""
    from swiglu_patch.kernels.layout import PackedGateUp, interleave_gate_up
    from swiglu_patch.training import gated_mlp

    class OursMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                w = interleave_gate_up(eager.gate_proj.weight, eager.up_proj.weight)
            self.gate_up_interleaved = torch.nn.Parameter(w)
            self.down = torch.nn.Parameter(eager.down_proj.weight.detach().clone())

        def forward(self, x):
            return gated_mlp(x, PackedGateUp(self.gate_up_interleaved), self.down, None, act, mode)

    return OursMLP()


class Batched(torch.nn.Module):
    """`inner` (a module that takes only [B, S, K] input: LigerMLP's fused kernels do) on 2-D
    x [M, K] as [1, M, K], its output back to [M, K]; other inputs pass through unchanged."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.unsqueeze(0)).squeeze(0) if x.dim() == 2 else self.inner(x)


def liger_modules(act: str, config, eager: torch.nn.Module) -> dict:
    """{name: module} of the Liger MLPs for act, built from config and loaded with eager's
    weights; {name: error message} where one is unavailable ({"liger": ...} if not installed)."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        return {"liger": f"not installed ({e})"}
    from .ways import fast_liger_autotune

    # LigerMLP tunes 32 configs for each of two kernels per (K, I, M bucket): shorter timing
    # still separates them, and the chosen config is then timed like every other way.
    fast_liger_autotune(5, 20, ("_swiglu_kernel_forward", "_swiglu_kernel_backward_dI"))
    out = {}
    classes = ([("liger_swiglu (LigerSwiGLUMLP)", "liger_kernel.transformers.swiglu", "LigerSwiGLUMLP"),
                ("liger_mlp (LigerMLP)", "liger_kernel.transformers.mlp", "LigerMLP")] if act == "silu" else
               [("liger_geglu (LigerGEGLUMLP)", "liger_kernel.transformers.geglu", "LigerGEGLUMLP")])
    weight = eager.gate_proj.weight
    for name, module_name, cls in classes:
        try:
            with torch.device(weight.device):
                mod = getattr(importlib.import_module(module_name), cls)(config).to(weight.dtype)
            mod.load_state_dict(eager.state_dict())
            out[name] = Batched(mod) if cls == "LigerMLP" else mod
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            out[name] = f"{type(e).__name__}: {e}"
    return out


class _SixGemms(torch.autograd.Function):
    """Forward: P = x @ W^T [M, 2I], y = P[:, :I] @ Wd^T [M, K]. Backward: dH = dY @ Wd [M, I],
    dWd = dY^T @ P[:, :I], dW = P^T @ x, dx = P @ W: the MLP's six GEMM shapes, with P standing
    in for dP and its first I columns (a strided view, no copy) for h. dH is computed and
    dropped; the values are not the MLP's gradients."""

    @staticmethod
    def forward(ctx, x, w, wd):
        p = torch.nn.functional.linear(x, w)
        ctx.save_for_backward(x, w, wd, p)
        return torch.nn.functional.linear(p[:, : wd.shape[1]], wd)

    @staticmethod
    def backward(ctx, dy):
        x, w, wd, p = ctx.saved_tensors
        dh = dy @ wd
        dwd = dy.t() @ p[:, : wd.shape[1]]
        del dh
        return p @ w, p.t() @ x, dwd


def gemm_floor_module(eager: torch.nn.Module) -> torch.nn.Module:
    """`_SixGemms` on copies of eager's weights ([2I, K] gate and up stacked, [K, I] down), for
    2-D x [M, K]: the GEMM time of one forward + backward, nothing else."""

    class SixGemms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                w = torch.cat([eager.gate_proj.weight, eager.up_proj.weight])
            self.gate_up = torch.nn.Parameter(w)
            self.down = torch.nn.Parameter(eager.down_proj.weight.detach().clone())

        def forward(self, x):
            return _SixGemms.apply(x, self.gate_up, self.down)

    return SixGemms()
