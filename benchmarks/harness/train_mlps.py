"""The MLP modules `bench_train` trains (forward + backward of one gated MLP), all on the same
weights: x [M, K] -> y [M, K] in the weights' dtype.

- `eager_module`: transformers' own class, `LlamaMLP` (silu) or `Gemma2MLP`
  (gelu_pytorch_tanh), random init; gate_proj, up_proj [I, K], down_proj [K, I], no biases.
- `ours_module`: `swiglu_patch.training.gated_mlp` on the eager module's weights, gate and up
  interleaved into one [2I, K] parameter, in "store" (P [M, 2I] saved) or "recompute" mode.
- `liger_modules`: Liger-Kernel's MLP classes for the activation, loaded with the eager
  module's state dict (`LigerSwiGLUMLP` and `LigerMLP` for silu, `LigerGEGLUMLP` otherwise).

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
            out[name] = mod
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            out[name] = f"{type(e).__name__}: {e}"
    return out
