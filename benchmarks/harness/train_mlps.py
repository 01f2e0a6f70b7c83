"""The MLP modules `bench_train` trains (forward + backward of one gated MLP), all on the same
weights: x [M, K] -> y [M, K] in the weights' dtype.

- `eager_module`: transformers' own class, `LlamaMLP` (silu) or `Gemma2MLP`
  (gelu_pytorch_tanh), random init; gate_proj, up_proj [I, K], down_proj [K, I], no biases.
- `ours_module`: `swiglu_patch.training.gated_mlp` on the eager module's weights, gate and up
  interleaved into one [2I, K] parameter, in "store" (P [M, 2I] saved) or "recompute" mode.
- `liger_modules`: Liger-Kernel's MLP classes for the activation, loaded with the eager
  module's state dict (`LigerSwiGLUMLP` and `LigerMLP` for silu, `LigerGEGLUMLP` otherwise);
  LigerMLP takes [B, S, K] only and runs on x as [1, M, K] (`Batched`).
- `quack_module`: quack's gated MLP (`quack.mlp.mlp_func`, CuTe DSL kernels for Hopper and
  Blackwell) with the eager module's weights, gate and up rows interleaved one by one
  ([2I, K], row 2j gate j, row 2j + 1 up j), as quack takes them.
- `gemm_floor_module`: not an MLP. The six GEMMs of a gated MLP's forward + backward alone, at
  cuBLAS's speed, with no activation, derivative or other elementwise op: the time any design
  built on cuBLAS-speed GEMMs cannot go below. Its gradients are not the MLP's.

transformers, swiglu_patch, Liger and quack are imported only when a module is built, never at import.
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


def ours_module(eager: torch.nn.Module, act: str, mode: str, split: bool = True) -> torch.nn.Module:
    """`gated_mlp` with act in mode ("store" or "recompute") on copies of eager's weights:
    `gate_up_interleaved` [2I, K] (gate and up rows interleaved) and `down` [K, I]. split=False:
    store mode keeps P in one tensor at every M (`training.preact_split` switched off by its
    threshold during each call), the A/B of the split."""
    from swiglu_patch import training
    from swiglu_patch.kernels.layout import PackedGateUp, interleave_gate_up
    from swiglu_patch.training import gated_mlp

    def call(*args):
        if split:
            return gated_mlp(*args)
        threshold, training.SPLIT_MIN_TOKENS = training.SPLIT_MIN_TOKENS, float("inf")
        try:
            return gated_mlp(*args)
        finally:
            training.SPLIT_MIN_TOKENS = threshold

    class OursMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                w = interleave_gate_up(eager.gate_proj.weight, eager.up_proj.weight)
            self.gate_up_interleaved = torch.nn.Parameter(w)
            self.down = torch.nn.Parameter(eager.down_proj.weight.detach().clone())

        def forward(self, x):
            return call(x, PackedGateUp(self.gate_up_interleaved), self.down, None, act, mode)

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


# bench_train's activation names -> quack's gated activations (both tanh-approximated GELU for gelu_tanh)
_QUACK_ACTIVATIONS = {"silu": "swiglu", "gelu_tanh": "geglu"}


def quack_module(act: str, eager: torch.nn.Module, check_tokens: int = 256,
                 tuned: bool = False) -> torch.nn.Module | str:
    """quack's gated MLP in its store mode (`mlp_func`: `gemm_gated` writes the pre-activation
    [M, 2I] and h from one GEMM's epilogue; `gemm_dgated` computes dH = dY @ Wd and writes dP
    from its epilogue; cuBLAS-free) on copies of eager's weights; untuned by default (quack's
    default tiles), or with quack's autotuner (`tuned`: each GEMM shape tunes on its first call,
    about 3 minutes per M on the Llama-3-8B shape on an H100). Before it is timed, y and dx on
    `check_tokens` random tokens must match eager's within 3e-2 relative error (bf16 and fp16
    noise is ~4e-3).

    Returns:
        the module, or a message naming why it cannot run (quack-kernels not installed, no
        kernel for this GPU, its output differs from eager's).
    """
    try:
        from quack.mlp import mlp_func
    except Exception as e:  # noqa: BLE001 - ImportError, or its CUDA libraries failing to load
        return f"quack-kernels not installed ({type(e).__name__}: {str(e)[:120]})"
    from .accuracy import rel_error

    activation = _QUACK_ACTIVATIONS[act]

    class QuackMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                w = torch.stack([eager.gate_proj.weight, eager.up_proj.weight], dim=1).flatten(0, 1)
            self.fc1 = torch.nn.Parameter(w.contiguous())
            self.fc2 = torch.nn.Parameter(eager.down_proj.weight.detach().clone())

        def forward(self, x):
            return mlp_func(x, self.fc1, self.fc2, activation=activation, tuned=tuned)

    module = QuackMLP()
    weight = eager.gate_proj.weight
    gen = torch.Generator(weight.device).manual_seed(0)
    x = torch.randn(check_tokens, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
    dy = torch.randn(check_tokens, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
    results = []
    try:
        for mod in (module, eager):
            xi = x.clone().requires_grad_(True)
            y = mod(xi)
            y.backward(dy)
            results.append((y.detach(), xi.grad))
    except Exception as e:  # noqa: BLE001 - recorded, the other ways still run
        return f"quack: {type(e).__name__}: {str(e)[:200]}"
    finally:
        for p in (*module.parameters(), *eager.parameters()):
            p.grad = None
    errors = {n: rel_error(a, b.double()) for n, a, b in zip(("y", "dx"), results[0], results[1])}
    if any(not e <= 3e-2 for e in errors.values()):
        return f"quack: differs from HF eager ({', '.join(f'{n} {e:.1e}' for n, e in errors.items())})"
    return module


def quack_parts(act: str, x: torch.Tensor, w: torch.Tensor, wd: torch.Tensor, dy: torch.Tensor) -> dict:
    """{name: (fn, flops as a multiple of M*K*I)} of quack's two fused GEMMs alone, untuned, on
    x [M, K], w [2I, K], wd [K, I], dy [M, K] (buffers made here): the forward's gated GEMM
    storing P and the backward's dY @ Wd with the gated derivative writing dP and h. {} where
    quack-kernels is not installed. Timing only: P holds the forward's values (one forward runs
    here), laid out as quack's."""
    try:
        from quack.gemm_interface import gemm_dgated_out, gemm_gated_out
    except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries failing to load
        return {}
    activation = _QUACK_ACTIVATIONS[act]
    m, i = x.shape[0], wd.shape[1]
    preact, dpreact = x.new_empty(m, 2 * i), x.new_empty(m, 2 * i)
    h = x.new_empty(m, i)
    gemm_gated_out(x, w.T, preact, h, activation=activation, tuned=False)  # the backward reads a real P
    return {
        "fwd: quack gemm_gated + P store (untuned)": (
            lambda: gemm_gated_out(x, w.T, preact, h, activation=activation, tuned=False), 4),
        "bwd: quack gemm_dgated: dY @ Wd + derivative -> dP, h (untuned)": (
            lambda: gemm_dgated_out(dy, wd, preact, dpreact, h, activation=activation, tuned=False), 2),
    }


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
