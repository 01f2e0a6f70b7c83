"""Training at the MLP level: forward + backward of one gated MLP, HF eager against Liger and
swiglu-patch's `gated_mlp` (store and recompute modes), with gradients checked against float64.

    python -m benchmarks.bench_train --out DIR [--commit SHA] [--budget-s 420]
    python -m benchmarks.bench_train --dry-run --out /tmp/x      # CPU: tiny shapes, interpreter

Self-contained (torch, transformers, swiglu_patch; liger_kernel when importable). Sections, each
printed as it runs; a section or way that fails is recorded with its error and the rest run:

1. correctness: y, dx, dW_gate_up (packed), db_gate_up, dW_down, db_down of both modes against
   float64 autograd on the unpacked weights, next to HF-eager-style PyTorch's error in the same
   dtype; PASS when ours <= 2 x eager's + eps (the issue's "within 2x of HF eager's own error").
2. table: fwd+bwd ms (median of CUDA-event timings, the ways interleaved in rounds, grads set
   to None before every step as a Trainer's zero_grad does), saved MiB (memory allocated after
   the forward, less the output, above what was allocated before: inputs and weights
   excluded), peak MiB (max allocated during forward + backward above the same base: the
   weight gradients count), ratios to HF eager, and the issue's targets per row.
3. parts: each kernel and GEMM of our forward and backward alone, against the cuBLAS GEMM of
   the same shape (what the fused epilogues cost).
4. tiles: alternative configs of the backward kernel and of the forward with STORE_PREACT,
   each checked against the rule's output and timed; then ours_store's fwd + bwd with the
   rules' tiles and with the fastest ones.
5. the registers, spills and shared memory of every training-kernel variant compiled.

Sections 3 and 4 are skipped past --budget-s (the order puts what the issue asks first).

Writes OUT/train.json (after every section) and OUT/train.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

MIB = 2**20
EPS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
GRADS = ("y", "dx", "dW_gate_up", "db_gate_up", "dW_down", "db_down")


@dataclasses.dataclass(frozen=True)
class Row:
    shape: str
    k: int
    i: int
    act: str
    m: int
    dtype: str

    def label(self) -> str:
        return f"{self.shape} M={self.m} {self.dtype}"


ROWS = [Row("llama-3-8b", 4096, 14336, "silu", 4096, "bfloat16"), Row("llama-3-8b", 4096, 14336, "silu", 8192, "bfloat16"),
        Row("gemma-2-9b", 3584, 14336, "gelu_tanh", 4096, "bfloat16"), Row("llama-3-8b", 4096, 14336, "silu", 4096, "float16")]
DRY_ROWS = [Row("tiny", 64, 96, "silu", 64, "float16"), Row("tiny-gemma", 48, 96, "gelu_tanh", 32, "float16")]
# (label, M, K, I, dtype, epilogue kwargs, bias, input scale): the rows' shapes plus paths they miss
CHECKS = [("llama-3-8b", 4096, 4096, 14336, "bfloat16", {"activation": "silu"}, False, 1.0),
          ("gemma-2-9b", 4096, 3584, 14336, "bfloat16", {"activation": "gelu_tanh"}, False, 1.0),
          ("llama-3-8b", 4096, 4096, 14336, "float16", {"activation": "silu"}, False, 1.0),
          ("fp32 small", 512, 1024, 2816, "float32", {"activation": "silu"}, True, 1.0),
          ("TMA, clamp, biases", 1024, 1024, 2048, "bfloat16", {"activation": "silu", "limit": 3.0}, True, 4.0),
          ("pointer: odd I, K", 199, 1000, 1000, "bfloat16", {"activation": "gelu", "limit": 2.0, "clamp": "activation",
                                                               "gate_scale": 0.9}, True, 4.0),
          ("one token", 1, 4096, 14336, "bfloat16", {"activation": "silu"}, False, 1.0)]
DRY_CHECKS = [("tiny", 33, 64, 96, "float16", {"activation": "silu"}, True, 1.0),
              ("tiny clamp", 7, 40, 37, "float32", {"activation": "gelu_tanh", "limit": 2.0}, True, 4.0)]


def _configs(dry: bool) -> tuple[list, list]:
    """[(name, kernel, config)] to try for the backward kernel and for the forward with P."""
    from swiglu_patch.kernels.configs import GatedGemmConfig as C

    if dry:
        bwd = [("backward_tma", C(16, 32, 16, group_m=2)), ("backward_pointer", C(16, 32, 16, group_m=2))]
        fwd = [("tma", C(16, 16, 16, group_m=2)), ("tma", C(16, 32, 16, group_m=2, split_tail=True))]
    else:
        t = dict(group_m=8, num_warps=8, num_stages=4)  # the rules' Hopper tile, varied one field at a time
        bwd = [("backward_tma", C(128, 128, 64, **t)), ("backward_tma", C(128, 128, 64, **t | {"num_stages": 3})),
               ("backward_tma", C(128, 128, 64, **t | {"group_m": 4})),
               ("backward_tma", C(128, 128, 64, **t, warp_specialize=True)),
               ("backward_tma", C(128, 128, 64, **t | {"num_stages": 3}, warp_specialize=True)),
               ("backward_tma", C(128, 128, 64, **t | {"group_m": 16})),
               ("backward_tma", C(128, 128, 128, **t | {"num_stages": 3})),
               ("backward_tma", C(128, 128, 32, **t | {"num_stages": 6})),
               ("backward_tma", C(128, 64, 64, **t | {"num_warps": 4})), ("backward_tma", C(128, 64, 64, **t)),
               ("backward_tma", C(64, 128, 64, **t | {"num_warps": 4, "num_stages": 2, "programs_per_sm": 2})),
               ("backward_tma", C(64, 64, 64, **t | {"num_warps": 4, "programs_per_sm": 2})),
               ("backward_pointer", C(64, 64, 64, num_warps=8, num_stages=3))]
        fwd = [("tma", C(128, 128, 64, **t, split_tail=True)), ("tma", C(128, 128, 64, **t | {"num_stages": 3},
                                                                         split_tail=True)),
               ("tma", C(128, 128, 64, **t | {"num_stages": 3}, warp_specialize=True, split_tail=True)),
               ("tma", C(128, 128, 64, **t)), ("tma", C(128, 64, 64, **t | {"num_warps": 4}, split_tail=True))]
    return ([(f"{k} {c.short()}", k, c) for k, c in bwd], [(f"{k} {c.short()}", k, c) for k, c in fwd])


# -- timing and memory ---------------------------------------------------------------------


class Timer:
    """Median seconds per call: CUDA events on the GPU (ways interleaved in rounds), perf_counter on CPU."""

    def __init__(self, cuda: bool, reps: int, rounds: int, warmup: int):
        self.cuda, self.reps, self.rounds, self.warmup = cuda, reps, rounds, warmup

    def many(self, fns: dict) -> dict:
        import torch

        samples = {name: [] for name in fns}
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        for _ in range(self.rounds):
            for name, fn in fns.items():
                if self.cuda:
                    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              for _ in range(self.reps)]
                    for start, end in events:
                        start.record()
                        fn()
                        end.record()
                    torch.cuda.synchronize()
                    samples[name] += [s.elapsed_time(e) / 1e3 for s, e in events]
                else:
                    for _ in range(self.reps):
                        t = time.perf_counter()
                        fn()
                        samples[name].append(time.perf_counter() - t)
        return {name: statistics.median(v) for name, v in samples.items()}


def _free(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def memory_of(module, x, dy, device) -> dict:
    """saved and peak MiB of one forward + backward (see the module docstring)."""
    import torch

    if device.type != "cuda":
        return {"saved_mib": None, "peak_mib": None}
    module.zero_grad(set_to_none=True)
    x.grad = None
    _free(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = module(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    module.zero_grad(set_to_none=True)
    x.grad = None
    return {"saved_mib": saved / MIB, "peak_mib": peak / MIB}


# -- the ways ------------------------------------------------------------------------------


def eager_module(row: Row, device, dtype):
    """HF's own MLP class: LlamaMLP (silu) or Gemma2MLP (gelu_pytorch_tanh), random init."""
    import torch

    with torch.device(device):
        if row.act == "silu":
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaMLP

            config = LlamaConfig(hidden_size=row.k, intermediate_size=row.i, hidden_act="silu")
            return LlamaMLP(config).to(dtype), config
        from transformers import Gemma2Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

        config = Gemma2Config(hidden_size=row.k, intermediate_size=row.i, hidden_activation="gelu_pytorch_tanh")
        return Gemma2MLP(config).to(dtype), config


def ours_module(eager, act: str, mode: str):
    import torch

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


def liger_modules(row: Row, config, eager) -> dict:
    """{name: module} of the Liger MLPs for this activation; {name: error} where unavailable."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        return {"liger": f"not installed ({e})"}
    _short_liger_autotune()
    out = {}
    classes = ([("liger_swiglu (LigerSwiGLUMLP)", "liger_kernel.transformers.swiglu", "LigerSwiGLUMLP"),
                ("liger_mlp (LigerMLP)", "liger_kernel.transformers.mlp", "LigerMLP")] if row.act == "silu" else
               [("liger_geglu (LigerGEGLUMLP)", "liger_kernel.transformers.geglu", "LigerGEGLUMLP")])
    weight = eager.gate_proj.weight
    for name, module_name, cls in classes:
        try:
            import importlib

            import torch

            with torch.device(weight.device):
                mod = getattr(importlib.import_module(module_name), cls)(config).to(weight.dtype)
            mod.load_state_dict(eager.state_dict())
            out[name] = mod
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _short_liger_autotune() -> None:
    """LigerMLP tunes 32 configs for each of two kernels per (K, I, M bucket), each timed by
    do_bench(warmup=25, rep=100); shorter timing still separates configs whose times differ by
    more than the noise, and the chosen config is then timed like every other way."""
    try:
        from liger_kernel.ops import mlp
        from triton.testing import do_bench
    except ImportError:
        return
    for name in ("_swiglu_kernel_forward", "_swiglu_kernel_backward_dI"):
        tuner = getattr(mlp, name, None)
        if tuner is not None and hasattr(tuner, "_do_bench"):
            tuner._do_bench = lambda fn, quantiles: do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@contextlib.contextmanager
def forced_tiles(bwd=None, fwd=None):
    """Run the op with these (kernel, config) pairs first in the dispatcher's rule tables."""
    from swiglu_patch.kernels import dispatch, dispatch_training
    from swiglu_patch.kernels.rules import Rule

    saved = dispatch_training.BACKWARD_RULES, dispatch.RULES
    if bwd:
        dispatch_training.BACKWARD_RULES = (Rule(bwd[0], bwd[1], why="forced by bench_train"),) + saved[0]
    if fwd:
        dispatch.RULES = (Rule(fwd[0], fwd[1], why="forced by bench_train"),) + saved[1]
    for cache in (dispatch._PLANS, dispatch_training._PREACT_PLANS, dispatch_training._BACKWARD_PLANS):
        cache.clear()
    try:
        yield
    finally:
        dispatch_training.BACKWARD_RULES, dispatch.RULES = saved
        for cache in (dispatch._PLANS, dispatch_training._PREACT_PLANS, dispatch_training._BACKWARD_PLANS):
            cache.clear()


# -- 1. correctness --------------------------------------------------------------------------


def rel_err(a, ref) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def _run(fn, leaves, dy) -> list:
    """[y, grad of each leaf (None for a None leaf)] of fn(*leaves) backpropagating dy."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in leaves]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def correctness(case, device) -> dict:
    """Both modes' six outputs against float64, next to HF-eager-style PyTorch in the same dtype."""
    import torch
    import torch.nn.functional as F

    from swiglu_patch.kernels.epilogue import GatedEpilogue
    from swiglu_patch.kernels.layout import PackedGateUp, interleave_gate_up
    from swiglu_patch.training import gated_mlp

    label, m, k, i, dtype_name, epi_kwargs, bias, scale = case
    dtype, epi = getattr(torch, dtype_name), GatedEpilogue(**epi_kwargs)
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * s).to(dtype)

    x, gate, up, wd, dy = rnd(m, k, s=scale), rnd(i, k, s=k**-0.5), rnd(i, k, s=k**-0.5), rnd(k, i, s=i**-0.5), rnd(m, k)
    bg, bu, bd = (rnd(i), rnd(i), rnd(k)) if bias else (None, None, None)

    def unpacked(x, gate, up, bg, bu, wd, bd):  # HF eager's math, in the dtype it is given
        return F.linear(epi.apply(F.linear(x, gate, bg), F.linear(x, up, bu)), wd, bd)

    def packed(r):  # [y, dx, dgate, dup, dbg, dbu, dwd, dbd] -> GRADS order
        y, dx, dgate, dup, dbg, dbu, dwd, dbd = r
        return [y, dx, interleave_gate_up(dgate, dup), interleave_gate_up(dbg, dbu) if bias else None, dwd, dbd]

    tensors = [x, gate, up, bg, bu, wd, bd]
    ref = packed(_run(unpacked, [t.double() if t is not None else None for t in tensors], dy.double()))
    same = packed(_run(unpacked, tensors, dy))
    out = {"case": label, "m": m, "k": k, "i": i, "dtype": dtype_name, "epilogue": epi.describe(), "bias": bias,
           "modes": {}}
    w, b = interleave_gate_up(gate, up), interleave_gate_up(bg, bu) if bias else None
    for mode in ("store", "recompute"):
        ours = _run(lambda x, w, b, wd, bd: gated_mlp(x, PackedGateUp(w, b), wd, bd, epi, mode), [x, w, b, wd, bd], dy)
        errs = {}
        for name, o, s, r in zip(GRADS, ours, same, ref):
            if r is None:
                continue
            finite = bool(torch.isfinite(o).all())
            e_ours, e_eager = rel_err(o, r), rel_err(s, r)
            errs[name] = {"ours": e_ours, "eager": e_eager, "finite": finite,
                          "pass": finite and e_ours <= 2 * e_eager + EPS[dtype_name]}
        out["modes"][mode] = errs
    return out


def print_correctness(r: dict) -> None:
    for mode, errs in r["modes"].items():
        ok = all(e["pass"] for e in errs.values())
        detail = ", ".join(f"{n} {e['ours']:.2e} (eager {e['eager']:.2e})" for n, e in errs.items())
        print(f"  {'PASS' if ok else 'FAIL'} {r['case']}: M={r['m']} K={r['k']} I={r['i']} {r['dtype']} "
              f"[{r['epilogue']}{', biases' if r['bias'] else ''}] {mode}: {detail}", flush=True)


# -- 2. parts ------------------------------------------------------------------------------


def parts(row: Row, device, timer: Timer) -> dict:
    """Each piece of our fwd + bwd alone, next to the cuBLAS GEMM of the same shape."""
    import torch
    import torch.nn.functional as F

    from swiglu_patch.kernels import dispatch, dispatch_training

    dtype = getattr(torch, row.dtype)
    m, k, i = row.m, row.k, row.i
    x, dy = torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(2 * i, k, device=device) * k**-0.5).to(dtype)
    wd = (torch.randn(k, i, device=device) * i**-0.5).to(dtype)
    h, preact = dispatch_training.gated_gemm_with_preact(x, w, row.act)
    dpreact = torch.empty_like(preact)
    fns = {
        "fwd: gated GEMM, inference kernel (no P)": (lambda: dispatch.gated_gemm(x, w, row.act, out=h), 4),
        "fwd: gated GEMM + P store": (lambda: dispatch_training.gated_gemm_with_preact(x, w, row.act, out=h,
                                                                                preact_out=preact), 4),
        "fwd: cuBLAS x @ W^T (gate/up GEMM only)": (lambda: F.linear(x, w), 4),
        "fwd: cuBLAS down h @ Wd^T": (lambda: F.linear(h, wd), 2),
        "bwd: fused dY @ Wd + derivative -> dP, h": (lambda: dispatch_training.gated_backward(
            dy, wd, preact, row.act, dpreact_out=dpreact, h_out=h), 2),
        "bwd: cuBLAS dY @ Wd alone": (lambda: dy @ wd, 2),
        "bwd: cuBLAS dWd = dY^T @ h": (lambda: dy.t() @ h, 2),
        "bwd: cuBLAS dW = dP^T @ x": (lambda: dpreact.t() @ x, 4),
        "bwd: cuBLAS dx = dP @ W": (lambda: dpreact @ w, 4),
    }
    times = timer.many({name: fn for name, (fn, _) in fns.items()})
    return {name: {"ms": t * 1e3, "tflops": mult * m * k * i / t / 1e12} for (name, (_, mult)), t in
            zip(fns.items(), times.values())}


# -- 3. tiles ------------------------------------------------------------------------------


def tiles(row: Row, device, timer: Timer, dry: bool) -> dict:
    """Time each alternative config of the two training kernels; check it against the rule's output."""
    import torch

    from swiglu_patch.kernels import dispatch, dispatch_training

    dtype = getattr(torch, row.dtype)
    m, k, i = row.m, row.k, row.i
    x, dy = torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(2 * i, k, device=device) * k**-0.5).to(dtype)
    wd = (torch.randn(k, i, device=device) * i**-0.5).to(dtype)
    h_ref, p_ref = dispatch_training.gated_gemm_with_preact(x, w, row.act)
    dp_ref, hb_ref = dispatch_training.gated_backward(dy, wd, p_ref, row.act)
    bwd_configs, fwd_configs = _configs(dry)
    out = {"backward": {}, "forward_preact": {}}
    for group, configs, run, refs in (
            ("backward", bwd_configs,
             lambda kern, cfg: dispatch_training.gated_backward(dy, wd, p_ref, row.act, config=cfg, kernel=kern),
             (dp_ref, hb_ref)),
            ("forward_preact", fwd_configs,
             lambda kern, cfg: dispatch_training.gated_gemm_with_preact(x, w, row.act, config=cfg, kernel=kern),
             (h_ref, p_ref))):
        for name, kern, cfg in configs:
            try:
                got = run(kern, cfg)
                err = max(rel_err(a, b) for a, b in zip(got, refs))
                if not err < 1e-2:
                    out[group][name] = {"error": f"differs from the rule's output: rel err {err:.3g}"}
                    continue
                t = timer.many({name: lambda kern=kern, cfg=cfg: run(kern, cfg)})[name]
                out[group][name] = {"ms": t * 1e3, "kernel": kern, "config": dataclasses.asdict(cfg), "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                out[group][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {group:15s} {name:40s} " + (f"{out[group][name]['ms']:.3f} ms" if "ms" in out[group][name]
                                                   else out[group][name]["error"]), flush=True)
    for group in list(out):
        timed = {n: r for n, r in out[group].items() if "ms" in r}
        out[group + "_best"] = min(timed, key=lambda n: timed[n]["ms"]) if timed else None
    return out


# -- 4. the table --------------------------------------------------------------------------


def _step(module, x, dy):
    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(dy)
    return step


def table_row(row: Row, device, timer: Timer, liger_mlp: bool) -> dict:
    """Every way's fwd + bwd time, saved and peak memory on one row, and the issue's targets."""
    import torch

    dtype = getattr(torch, row.dtype)
    eager, config = eager_module(row, device, dtype)
    ways = {"hf_eager": eager}
    if device.type == "cuda":
        ways |= {n: m for n, m in liger_modules(row, config, eager).items() if liger_mlp or "LigerMLP" not in n}
    ways |= {"ours_store": ours_module(eager, row.act, "store"), "ours_recompute": ours_module(eager, row.act, "recompute")}
    x = torch.randn(row.m, row.k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(row.m, row.k, device=device, dtype=dtype)
    results, steps = {}, {}
    for name, module in ways.items():
        if isinstance(module, str):
            results[name] = {"error": module}
            continue
        try:
            t0 = time.time()
            _step(module, x, dy)()  # compiles, autotunes
            results[name] = memory_of(module, x, dy, device) | {"first_step_s": time.time() - t0}
            steps[name] = _step(module, x, dy)
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
    for name, t in timer.many(steps).items():
        results[name]["ms"] = t * 1e3
    eager_ms = results["hf_eager"].get("ms")
    for r in results.values():
        if "ms" in r and eager_ms:
            r["vs_eager"] = r["ms"] / eager_ms
    del ways, steps
    _free(device)
    return {"row": dataclasses.asdict(row), "ways": results, "targets": targets(row, results)}


def best_tiles_step(row: Row, device, timer: Timer, best: dict) -> dict:
    """ours_store's fwd + bwd with the rules' tiles, then with the sweep's fastest (forced first in
    the rule tables), on one row's shape: what shipping the sweep's choice would give."""
    import torch

    dtype = getattr(torch, row.dtype)
    eager, _ = eager_module(row, device, dtype)
    module = ours_module(eager, row.act, "store")
    del eager
    x = torch.randn(row.m, row.k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(row.m, row.k, device=device, dtype=dtype)
    step = _step(module, x, dy)
    out = {"rules_ms": timer.many({"rules": step})["rules"] * 1e3,
           "tiles": {k: [v[0], dataclasses.asdict(v[1])] for k, v in best.items() if v}}
    with forced_tiles(best.get("backward"), best.get("forward_preact")):
        out["best_ms"] = timer.many({"best": step})["best"] * 1e3
    del module, step
    _free(device)
    return out


def targets(row: Row, ways: dict) -> dict:
    """The issue's targets, each True/False (None where a number is missing)."""
    elem = 2 if row.dtype != "float32" else 4
    store, rec, eager = ways.get("ours_store", {}), ways.get("ours_recompute", {}), ways.get("hf_eager", {})
    others = [r["ms"] for n, r in ways.items() if not n.startswith("ours") and "ms" in r]
    elementwise = next((r for n, r in ways.items() if n.startswith(("liger_swiglu", "liger_geglu")) and "peak_mib" in r),
                       None)

    def cmp(a, b, f):
        return None if a is None or b is None else bool(f(a, b))

    return {
        "store: time <= 0.95 x HF eager": cmp(store.get("ms"), eager.get("ms"), lambda a, b: a <= 0.95 * b),
        "store: faster than every other way": cmp(store.get("ms"), min(others) if others else None, lambda a, b: a < b),
        "store: saved <= 2*M*I*2 bytes": cmp(store.get("saved_mib"), 2 * row.m * row.i * 2 / MIB, lambda a, b: a <= b),
        "store: peak <= Liger elementwise's": cmp(store.get("peak_mib"), (elementwise or {}).get("peak_mib"),
                                                  lambda a, b: a <= b),
        "recompute: time <= 1.15 x HF eager": cmp(rec.get("ms"), eager.get("ms"), lambda a, b: a <= 1.15 * b),
        "recompute: saved <= 0.1*M*I elements": cmp(rec.get("saved_mib"), 0.1 * row.m * row.i * elem / MIB,
                                                    lambda a, b: a <= b),
    }


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def render(results: dict) -> str:
    env = results["environment"]
    lines = [f"# bench_train: {env['gpu'].get('name')}, torch {env['versions'].get('torch')}, "
             f"triton {env['versions'].get('triton')}, commit {env['git'].get('commit')}", ""]
    lines += ["## Gradients against float64 (ours / HF-eager-style same-dtype error; PASS: ours <= 2x + eps)", "",
              "| case | dtype | epilogue | mode | " + " | ".join(GRADS) + " | |", "|" + "---|" * (len(GRADS) + 5)]
    for r in results.get("correctness", []):
        if "error" in r:
            lines.append(f"| {r['case']} | | | | error: {r['error']} |")
            continue
        for mode, errs in r["modes"].items():
            cells = [f"{errs[g]['ours']:.2e} / {errs[g]['eager']:.2e}" if g in errs else "" for g in GRADS]
            ok = all(e["pass"] for e in errs.values())
            lines.append(f"| {r['case']} (M={r['m']}) | {r['dtype']} | {r['epilogue']}{', biases' if r['bias'] else ''} "
                         f"| {mode} | " + " | ".join(cells) + f" | {'PASS' if ok else 'FAIL'} |")
    for label, p in results.get("parts", {}).items():
        lines += ["", f"## Parts, {label}", "", "| part | ms | TFLOP/s |", "|---|---:|---:|"]
        lines += [f"| {n} | {v['ms']:.3f} | {v['tflops']:.0f} |" for n, v in p.items()] if "error" not in p else [
            f"| error | {p['error']} | |"]
    for label, t in results.get("tiles", {}).items():
        lines += ["", f"## Tiles, {label}", "", "| kernel | config | ms |", "|---|---|---:|"]
        for group in ("backward", "forward_preact"):
            for n, v in t.get(group, {}).items():
                lines.append(f"| {group} | {n} | {_fmt(v.get('ms'), '.3f') or v.get('error')} |")
            lines.append(f"| {group} | best: {t.get(group + '_best')} | |")
        fb = t.get("ours_store_fwd_bwd")
        if fb:
            lines.append(f"| ours_store fwd+bwd | rules' tiles / the sweep's best | {fb['rules_ms']:.3f} / "
                         f"{fb['best_ms']:.3f} |")
    for r in results.get("table", []):
        row = Row(**r["row"])
        lines += ["", f"## {row.label()} ({row.act}, K={row.k}, I={row.i}): forward + backward", "",
                  "| way | fwd+bwd ms | vs HF eager | saved after forward, MiB | peak above inputs, MiB |",
                  "|---|---:|---:|---:|---:|"]
        for n, v in r["ways"].items():
            if "error" in v:
                lines.append(f"| {n} | {v['error']} | | | |")
                continue
            lines.append(f"| {n} | {_fmt(v.get('ms'), '.3f')} | {_fmt(v.get('vs_eager'), '.3f')} | "
                         f"{_fmt(v.get('saved_mib'), '.0f')} | {_fmt(v.get('peak_mib'), '.0f')} |")
        lines += [""] + [f"- {'MET' if ok else ('MISSED' if ok is False else 'n/a')}: {t}" for t, ok in
                         r["targets"].items()]
    kernels = [k for k in results.get("compiled_kernels", []) if "kernel" in k]
    if kernels:
        cols = ["kernel", "dtype", "n_regs", "n_spills", "shared", "num_warps", "num_stages", "BLOCK_SIZE_M", "BLOCK_SIZE_N",
                "BLOCK_SIZE_K", "STORE_PREACT", "ACTIVATION", "CLAMP"]
        lines += ["", "## Compiled kernels", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(k.get(c, "")) for c in cols) + " |" for k in kernels]
    return "\n".join(lines) + "\n"


def compiled_kernels() -> list[dict]:
    """Registers, spills and shared memory of every variant of our training kernels compiled in
    this run (Triton's launcher metadata; empty under the interpreter)."""
    from swiglu_patch.kernels import gated_backward_pointer, gated_backward_tma, gated_gemm_pointer, gated_gemm_tma

    keep = ("STORE_PREACT", "ACTIVATION", "CLAMP", "HAS_BIAS", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K",
            "GROUP_SIZE_M", "WARP_SPECIALIZE", "TAIL_SPLIT", "NUM_PROGRAMS")
    out = []
    for fn in (gated_gemm_tma._gated_gemm_tma_kernel, gated_gemm_pointer._gated_gemm_fwd_kernel,
               gated_backward_tma._gated_backward_tma_kernel, gated_backward_pointer._gated_backward_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            for kernel in (entry[0] if isinstance(entry, tuple) else {}).values():
                try:
                    names = kernel.src.fn.arg_names
                    consts = {names[key[0]]: v for key, v in kernel.src.constexprs.items() if names[key[0]] in keep}
                except Exception:  # noqa: BLE001 - the constexprs are a label, not a result
                    consts = {}
                meta = kernel.metadata
                out.append({"kernel": kernel.name, "n_regs": getattr(kernel, "n_regs", None),
                            "n_spills": getattr(kernel, "n_spills", None), "shared": meta.shared,
                            "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                            "dtype": str(kernel.src.signature.get(names[0])) if consts else None} | consts)
    return out


# -- main ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (train.json, train.md)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    p.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="past this many seconds the parts and tiles are skipped (LigerMLP past half of it)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per way per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-liger-mlp", action="store_true", help="skip LigerMLP (it autotunes 2 x 32 configs per M)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before swiglu_patch imports Triton's kernels
    import torch

    from swiglu_patch.provenance import environment

    start = time.time()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    rows, checks = (ROWS, CHECKS) if cuda else (DRY_ROWS, DRY_CHECKS)
    if not cuda and not args.dry_run:
        print("bench_train: no CUDA device; pass --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    from swiglu_patch.kernels.device import interpreting

    if args.dry_run and not interpreting():
        print("bench_train: --dry-run runs the kernels in Triton's interpreter, but this process imported Triton "
              "without it; run it in a fresh process (it sets TRITON_INTERPRET=1) or with TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    timer = Timer(cuda, reps=args.reps if cuda else 2, rounds=args.rounds if cuda else 1, warmup=3 if cuda else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(device, args.commit), "timer": vars(timer), "correctness": [], "parts": {},
               "tiles": {}, "table": []}

    def save():
        (args.out / "train.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "train.md").write_text(render(results))

    def elapsed():
        return f"[{time.time() - start:.0f} s]"

    print(f"bench_train on {results['environment']['gpu'].get('name')} {elapsed()}", flush=True)
    print("1. gradients against float64 (ours vs HF-eager-style same-dtype error)", flush=True)
    for case in checks:
        try:
            r = correctness(case, device)
            print_correctness(r)
        except Exception as e:  # noqa: BLE001 - recorded; the rest runs
            traceback.print_exc()
            r = {"case": case[0], "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  FAIL {case[0]}: {r['error']}", flush=True)
        results["correctness"].append(r)
        _free(device)
        save()
    print(f"2. forward + backward {elapsed()}", flush=True)
    for row in rows:
        # LigerMLP autotunes 2 x 32 configs per dtype: bf16 rows only, early in the budget only
        liger_mlp = not args.no_liger_mlp and row.dtype == "bfloat16" and time.time() - start < args.budget_s / 2
        if cuda and not liger_mlp:
            print("  LigerMLP skipped (--no-liger-mlp, not bf16, or past half the budget)", flush=True)
        try:
            r = table_row(row, device, timer, liger_mlp)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = {"row": dataclasses.asdict(row), "ways": {"all": {"error": f"{type(e).__name__}: {str(e)[:300]}"}},
                 "targets": {}}
        results["table"].append(r)
        for n, v in r["ways"].items():
            print(f"  {row.label():28s} {n:34s} " + (v["error"] if "error" in v else
                  f"{_fmt(v.get('ms'), '8.3f')} ms  x{_fmt(v.get('vs_eager'), '.3f')}  saved {_fmt(v.get('saved_mib'), '.0f')} MiB"
                  f"  peak {_fmt(v.get('peak_mib'), '.0f')} MiB"), flush=True)
        for t, ok in r["targets"].items():
            print(f"    {'MET' if ok else ('MISSED' if ok is False else 'n/a')}: {t}", flush=True)
        _free(device)
        save()
    print(f"3. parts {elapsed()}", flush=True)
    for row in rows:
        if time.time() - start > args.budget_s:
            print(f"  skipped {row.label()}: past the budget", flush=True)
            continue
        try:
            results["parts"][row.label()] = parts(row, device, timer)
            for n, v in results["parts"][row.label()].items():
                print(f"  {row.label():28s} {n:45s} {v['ms']:8.3f} ms {v['tflops']:6.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["parts"][row.label()] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        _free(device)
        save()
    print(f"4. tiles {elapsed()}", flush=True)
    for row in (r for r in rows if r.shape == rows[0].shape and r.dtype == rows[0].dtype):
        if time.time() - start > args.budget_s:
            print(f"  skipped {row.label()}: past the budget", flush=True)
            continue
        try:
            t = results["tiles"][row.label()] = tiles(row, device, timer, not cuda)
            bwd, fwd = _configs(not cuda)
            best = {"backward": next(((k, c) for name, k, c in bwd if name == t["backward_best"]), None),
                    "forward_preact": next(((k, c) for name, k, c in fwd if name == t["forward_preact_best"]), None)}
            t["ours_store_fwd_bwd"] = best_tiles_step(row, device, timer, best)
            print(f"  ours_store fwd+bwd: rules' tiles {t['ours_store_fwd_bwd']['rules_ms']:.3f} ms, the sweep's "
                  f"best {t['ours_store_fwd_bwd']['best_ms']:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["tiles"][row.label()] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        _free(device)
        save()
    print(f"5. compiled kernels (registers, spills, shared bytes) {elapsed()}", flush=True)
    try:
        results["compiled_kernels"] = compiled_kernels()
        for k in results["compiled_kernels"]:
            print(f"  {k}", flush=True)
    except Exception as e:  # noqa: BLE001
        results["compiled_kernels"] = [{"error": f"{type(e).__name__}: {e}"}]
    save()
    print(f"done {elapsed()}; wrote {args.out / 'train.json'} and {args.out / 'train.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
