"""The ways of computing the first half of a gated MLP that the benchmark compares.

Every way reads the same operands (`Operands`) and returns a 2-D tensor:

- ``ours``: `swiglu_patch.gated_linear(x, packed, activation)` on the weight packed by
  `pack_gate_up` -> [M, I].
- ``gemm_only``: cuBLAS ``x @ W.T`` on the stacked [2I, K] weight ([Wg; Wu]), no activation
  -> [M, 2I]. Not a way to get the MLP's output: what any unfused design pays before its
  activation, so ``ours / gemm_only`` is the price (or the gain) of fusing.
- ``hf_eager``: what `LlamaMLP` computes before down_proj, with transformers' own activation
  module: ``ACT2FN[act](F.linear(x, Wg)) * F.linear(x, Wu)`` -> [M, I].
- ``torch_compile``: `torch.compile(hf_eager, dynamic=False)`, default mode: one graph per
  (shape, M), compiled on the first call (the accuracy check), not timed.
- ``liger``: Liger-Kernel's fused Triton kernel ``liger_kernel.ops.mlp.gemm_swiglu(x[1, M, K],
  Wg, Wu, gate_multiplier=1.0, store_preact=False)`` (two accumulators, TMA descriptors; the
  inference path stores only the [M, I] product). SiLU only, CUDA only, when liger-kernel
  is importable. It autotunes 32 configs per (K, I, M bucket) on its first call.

Liger, transformers and swiglu_patch are imported only when a way is built, never at import.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# swiglu_patch activation name -> transformers ACT2FN key (Gemma 2: gelu_pytorch_tanh).
HF_ACT_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}

WAY_NAMES = ("ours", "gemm_only", "hf_eager", "torch_compile", "liger")


@dataclass
class Operands:
    """One shape's tensors, shared by every way.

    Attributes:
        x: [M, K] input.
        stacked: [2I, K] = [Wg; Wu], contiguous.
        gate: [I, K] view of stacked's first I rows (contiguous).
        up: [I, K] view of stacked's last I rows (contiguous).
        packed: `pack_gate_up(gate, up)` (a PackedGateUp: [2I, K] weight), or None if swiglu_patch is missing.
        activation: "silu", "gelu_tanh" or "gelu".
        backend: the `gated_linear` backend for ours ("auto" on the GPU, "torch" in dry runs).
    """

    x: torch.Tensor
    stacked: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    packed: object | None
    activation: str
    backend: str


def swiglu_patch_missing() -> str | None:
    """None if `swiglu_patch` imports, else the reason and the fix."""
    try:
        from swiglu_patch import gated_linear  # noqa: F401  (imports the kernels, which need the install)
    except ImportError as e:
        return f"swiglu_patch does not import ({e}); run `pip install --no-deps -e .` in the repo root"
    return None


def liger_missing() -> str | None:
    """None if Liger's `gemm_swiglu` can run here, else why not."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed (`pip install --no-deps liger_kernel-0.8.5-py3-none-any.whl`)"
    try:
        from liger_kernel.ops import mlp
    except Exception as e:  # noqa: BLE001  (an optional comparator: any import failure is a skip)
        return f"liger_kernel.ops.mlp does not import: {type(e).__name__}: {e}"
    if not hasattr(mlp, "gemm_swiglu"):
        return "liger_kernel.ops.mlp has no gemm_swiglu (this benchmark reads liger-kernel 0.8.5's API)"
    if getattr(mlp, "TensorDescriptor", None) is None:
        return "this Triton has no triton.tools.tensor_descriptor, which Liger's gemm_swiglu needs"
    return None


def unavailable(way: str, activation: str, device: torch.device) -> str | None:
    """Why `way` cannot run for this activation on this device, or None if it can.

    Raises:
        ValueError: an unknown way name.
    """
    if way not in WAY_NAMES:
        raise ValueError(f"unknown way {way!r}; known: {', '.join(WAY_NAMES)}")
    if way == "ours":
        return swiglu_patch_missing()
    if way == "liger":
        if device.type != "cuda":
            return "Liger's gemm_swiglu needs CUDA (TMA descriptors)"
        if activation != "silu":
            return f"Liger's gemm_swiglu is SiLU only, this shape uses {activation}"
        return liger_missing()
    return None


def output_kind(way: str) -> str:
    """"preact" for gemm_only ([M, 2I] pre-activation), "gated" ([M, I]) for the others."""
    return "preact" if way == "gemm_only" else "gated"


def hf_gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """LlamaMLP's first half as a function of (x, gate, up)."""

    def first_half(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(F.linear(x, gate)) * F.linear(x, up)

    return first_half


class CompiledEager:
    """torch.compile of `hf_gated`, one per shape and dtype, recompiled for each new M.

    dynamic=False makes every M its own static graph (what a serving stack that compiles per
    batch size runs). Dynamo stops recompiling a function after `recompile_limit` shapes and
    silently falls back to eager; the limit is raised to cover every M of a run, and
    `torch._dynamo.reset()` at construction drops the graphs of the previous shape.
    """

    def __init__(self, activation: str, n_tokens: int):
        from transformers.activations import ACT2FN

        torch._dynamo.reset()
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), n_tokens + 8))
        self.fn = torch.compile(hf_gated(ACT2FN[HF_ACT_NAMES[activation]]), dynamic=False)


def build(way: str, ops: Operands, compiled: CompiledEager | None = None) -> Callable[[], torch.Tensor]:
    """A zero-argument callable that runs `way` on `ops` and returns its 2-D output.

    Args:
        way: one of WAY_NAMES; check `unavailable` first.
        ops: the operands.
        compiled: the shape's CompiledEager, needed for "torch_compile".

    Raises:
        ValueError: unknown way, or torch_compile without `compiled`.
    """
    x, act = ops.x, ops.activation
    if way == "ours":
        from swiglu_patch import gated_linear

        packed, backend = ops.packed, ops.backend
        return lambda: gated_linear(x, packed, act, backend=backend)
    if way == "gemm_only":
        w_t = ops.stacked.T
        return lambda: torch.matmul(x, w_t)
    if way == "hf_eager":
        from transformers.activations import ACT2FN

        fn = hf_gated(ACT2FN[HF_ACT_NAMES[act]])
        gate, up = ops.gate, ops.up
        return lambda: fn(x, gate, up)
    if way == "torch_compile":
        if compiled is None:
            raise ValueError("build('torch_compile'): pass the shape's CompiledEager")
        gate, up, fn = ops.gate, ops.up, compiled.fn
        return lambda: fn(x, gate, up)
    if way == "liger":
        from liger_kernel.ops.mlp import gemm_swiglu

        x3, gate, up = x.view(1, *x.shape), ops.gate, ops.up
        return lambda: gemm_swiglu(x3, gate, up, 1.0, store_preact=False)[0].view(x.shape[0], -1)
    raise ValueError(f"unknown way {way!r}; known: {', '.join(WAY_NAMES)}")


def fast_liger_autotune(warmup_ms: float, rep_ms: float,
                        kernels: tuple[str, ...] = ("_swiglu_kernel_forward_inference",)) -> bool:
    """Make Liger's MLP autotuners (`liger_kernel.ops.mlp.<kernels>`, by default the inference
    kernel's) time each config with a shorter do_bench.

    Liger tunes 32 configs per (K, I, M bucket) with do_bench(warmup=25, rep=100): about 4 s
    per bucket, 9 buckets per shape, which alone would take minutes of the run. Shorter
    timing still picks among configs whose times differ by far more than the noise; the
    chosen config is then timed exactly like every other way.

    Returns:
        True if every autotuner named was found and changed.
    """
    from triton.testing import do_bench
    from liger_kernel.ops import mlp

    found = 0
    for name in kernels:
        tuner = getattr(mlp, name, None)
        if tuner is not None and hasattr(tuner, "_do_bench"):
            tuner._do_bench = lambda fn, quantiles: do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles)
            found += 1
    return found == len(kernels)
