"""Training at the MLP level: forward + backward of one gated MLP, HF eager against Liger, quack
(where installed) and swiglu-patch's `gated_mlp` (store and recompute modes, and store with P in one tensor,
`ours_store_one_p`, the A/B of `training.preact_split`; the modules are `harness/train_mlps.py`), with gradients
checked against float64.

    python -m benchmarks.bench_train --out DIR [--commit SHA] [--budget-s 420]
    python -m benchmarks.bench_train --dry-run --out /tmp/x      # CPU: tiny shapes, interpreter

Sections, each printed as it runs; a section or way that fails is recorded with its error and
the rest run:

1. correctness: y, dx, dW_gate_up (packed), db_gate_up, dW_down, db_down of both modes against
   float64 autograd on the unpacked weights, next to HF-eager-style PyTorch's error in the same
   dtype; PASS when ours <= 2 x eager's + eps ("within 2x of HF eager's own error").
2. table: fwd+bwd ms (`harness.timing.EventTimer`: CUDA events around eager calls, the ways
   interleaved in rounds, grads set to None before every step as a Trainer's zero_grad does),
   saved MiB (memory allocated after the forward, less the output, above what was allocated
   before: inputs and weights excluded), peak MiB (max allocated during forward + backward above
   the same base: the weight gradients count; the step and both memories: `harness/fwd_bwd.py`),
   ratios to HF eager, and the targets per row. Timed with them, as a bound and not a way: the
   six GEMMs of a forward + backward alone (`train_mlps.gemm_floor_module`), the time below
   which no design on cuBLAS-speed GEMMs goes. The SM clock and board power while the row
   is timed (`harness/gpu_clock.py`): at the power cap the clock falls and a step's time follows
   the energy it spends.
3. parts: each kernel and GEMM of our forward and backward alone, through the public entry
   points (`gated_gemm`, `gated_gemm_with_preact`, `gated_backward`), against the cuBLAS GEMM
   of the same shape (what the fused epilogues cost) and quack's two fused GEMMs where quack
   is installed; skipped past --budget-s.

The training kernels' tile sweeps are `python -m benchmarks.tune --sweep backward` and
`--sweep preact`. Writes OUT/train.json (after every section) and OUT/train.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
import traceback
from pathlib import Path

from .harness.accuracy import rel_error
from .harness.cli import Parser, guarded, require_device, write_json
from .harness.fwd_bwd import MIB, memory_of, step_fn
from .harness.gpu_clock import ClockSampler, describe
from .harness.sweep_ops import entry_points
from .harness.timing import EventTimer
from .harness.train_mlps import eager_module, gemm_floor_module, liger_modules, ours_module, quack_module, quack_parts

PROG = "python -m benchmarks.bench_train"
EPS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
GRADS = ("y", "dx", "dW_gate_up", "db_gate_up", "dW_down", "db_down")
FLOOR = "floor: the six GEMMs alone"  # a row's cuBLAS GEMMs with nothing between them: not a way, a bound


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


# -- cleanup -------------------------------------------------------------------------------


def _free(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- 1. correctness --------------------------------------------------------------------------


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
            e_ours, e_eager = rel_error(o, r.double()), rel_error(s, r.double())
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


# -- 3. parts ------------------------------------------------------------------------------


def parts(row: Row, device, timer: EventTimer) -> dict:
    """Each piece of our fwd + bwd alone, next to the cuBLAS GEMM of the same shape."""
    import torch
    import torch.nn.functional as F

    from swiglu_patch.kernels import dispatch

    training = entry_points()  # gated_gemm_with_preact, gated_backward
    dtype = getattr(torch, row.dtype)
    m, k, i = row.m, row.k, row.i
    x, dy = torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(2 * i, k, device=device) * k**-0.5).to(dtype)
    wd = (torch.randn(k, i, device=device) * i**-0.5).to(dtype)
    h, preact = training.gated_gemm_with_preact(x, w, row.act)
    dpreact = torch.empty_like(preact)
    fns = {
        "fwd: gated GEMM, inference kernel (no P)": (lambda: dispatch.gated_gemm(x, w, row.act, out=h), 4),
        "fwd: gated GEMM + P store": (lambda: training.gated_gemm_with_preact(x, w, row.act, out=h,
                                                                                preact_out=preact), 4),
        "fwd: cuBLAS x @ W^T (gate/up GEMM only)": (lambda: F.linear(x, w), 4),
        "fwd: cuBLAS down h @ Wd^T": (lambda: F.linear(h, wd), 2),
        "bwd: dY @ Wd + derivative -> dP, h (the rules' kernel)": (lambda: training.gated_backward(
            dy, wd, preact, row.act, dpreact_out=dpreact, h_out=h), 2),
        "bwd: the same, fused TMA kernel (dH in registers)": (lambda: training.gated_backward(
            dy, wd, preact, row.act, dpreact_out=dpreact, h_out=h, kernel="backward_tma"), 2),
        "bwd: the same, split kernel (cuBLAS dH, elementwise pass)": (lambda: training.gated_backward(
            dy, wd, preact, row.act, dpreact_out=dpreact, h_out=h, kernel="backward_split"), 2),
        "bwd: the same, warp-specialized kernel (epilogue beside the next tile's MMAs)": (
            lambda: training.gated_backward(dy, wd, preact, row.act, dpreact_out=dpreact, h_out=h, kernel="backward_ws"),
            2),
        "bwd: cuBLAS dY @ Wd alone": (lambda: dy @ wd, 2),
        "bwd: cuBLAS dWd = dY^T @ h": (lambda: dy.t() @ h, 2),
        "bwd: cuBLAS dW = dP^T @ x": (lambda: dpreact.t() @ x, 4),
        "bwd: cuBLAS dx = dP @ W": (lambda: dpreact @ w, 4),
    } | quack_parts(row.act, x, w, wd, dy)
    if not dispatch.MODULES["backward_ws"].can_run(dy, wd, preact, dpreact, h):  # a Hopper GPU's kernel
        fns = {name: way for name, way in fns.items() if "warp-specialized" not in name}
    times = timer.many({name: fn for name, (fn, _) in fns.items()})
    return {name: {"ms": t * 1e3, "tflops": mult * m * k * i / t / 1e12} for (name, (_, mult)), t in
            zip(fns.items(), times.values())}


# -- 2. the table --------------------------------------------------------------------------


def table_row(row: Row, device, timer: EventTimer, liger_mlp: bool, quack_tuned: bool = False) -> dict:
    """Every way's fwd + bwd time, saved and peak memory on one row, and the targets."""
    import torch

    dtype = getattr(torch, row.dtype)
    eager, config = eager_module(row.act, row.k, row.i, device, dtype)
    ways = {"hf_eager": eager}
    if device.type == "cuda":
        ways |= {n: m for n, m in liger_modules(row.act, config, eager).items() if liger_mlp or "LigerMLP" not in n}
        ways[f"quack (mlp_func, {'tuned' if quack_tuned else 'untuned'})"] = quack_module(row.act, eager, tuned=quack_tuned)
    ways |= {"ours_store": ours_module(eager, row.act, "store"),
             "ours_store_one_p": ours_module(eager, row.act, "store", split=False),
             "ours_recompute": ours_module(eager, row.act, "recompute"), FLOOR: gemm_floor_module(eager)}
    x = torch.randn(row.m, row.k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(row.m, row.k, device=device, dtype=dtype)
    results, steps = {}, {}
    for name, module in ways.items():
        if isinstance(module, str):
            results[name] = {"error": module}
            continue
        try:
            fwd, leaves = functools.partial(module, x), {**dict(module.named_parameters()), "x": x}
            t0 = time.time()
            step_fn(fwd, leaves, dy)()  # compiles, autotunes
            results[name] = memory_of(fwd, leaves, dy) | {"first_step_s": time.time() - t0}
            steps[name] = step_fn(fwd, leaves, dy)
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
    with ClockSampler(device.index or 0) if device.type == "cuda" else contextlib.nullcontext() as clock:
        times = timer.many(steps)
    for name, t in times.items():
        results[name]["ms"] = t * 1e3
    eager_ms = results["hf_eager"].get("ms")
    for r in results.values():
        if "ms" in r and eager_ms:
            r["vs_eager"] = r["ms"] / eager_ms
    del ways, steps
    _free(device)
    return {"row": dataclasses.asdict(row), "ways": results, "targets": targets(row, results),
            "clock": clock.summary() if clock else None}


def targets(row: Row, ways: dict) -> dict:
    """The training targets, each True/False (None where a number is missing)."""
    elem = 2 if row.dtype != "float32" else 4
    store, rec, eager = ways.get("ours_store", {}), ways.get("ours_recompute", {}), ways.get("hf_eager", {})
    others = [r["ms"] for n, r in ways.items() if not n.startswith("ours") and n != FLOOR and "ms" in r]
    elementwise = next((r for n, r in ways.items() if n.startswith(("liger_swiglu", "liger_geglu")) and "peak_mib" in r),
                       None)

    elementwise_ms = next((r for n, r in ways.items() if n.startswith(("liger_swiglu", "liger_geglu")) and "ms" in r),
                          None)

    def cmp(a, b, f):
        return None if a is None or b is None else bool(f(a, b))

    return {
        "store: time <= 0.92 x HF eager": cmp(store.get("ms"), eager.get("ms"), lambda a, b: a <= 0.92 * b),
        "store: time <= 0.97 x Liger elementwise": cmp(store.get("ms"), (elementwise_ms or {}).get("ms"),
                                                       lambda a, b: a <= 0.97 * b),
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
        floor = r["ways"].get(FLOOR, {})
        if "vs_eager" in floor:
            lines.append(f"- floor: the six GEMMs alone (cuBLAS, no elementwise op) take {floor['vs_eager']:.3f} x HF "
                         "eager's time; a ratio below it needs GEMMs faster than cuBLAS's")
        if describe(r.get("clock")):
            lines.append(f"- {describe(r['clock'])}")
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (train.json, train.md)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    p.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="past this many seconds the parts are skipped (LigerMLP past half of it)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per way per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-liger-mlp", action="store_true", help="skip LigerMLP (it autotunes 2 x 32 configs per M)")
    p.add_argument("--quack-tuned", action="store_true",
                   help="time quack's MLP with its autotuner (about 3 minutes per row on an H100) instead of untuned")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # in time if Triton is not imported yet
    import torch

    from swiglu_patch.provenance import environment

    require_device(PROG, args.dry_run)
    start = time.time()
    cuda = not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    rows, checks = (ROWS, CHECKS) if cuda else (DRY_ROWS, DRY_CHECKS)
    timer = EventTimer(cuda, reps=args.reps if cuda else 2, rounds=args.rounds if cuda else 1, warmup=3 if cuda else 1)
    results = {"environment": environment(device, args.commit), "timer": timer.describe(), "correctness": [],
               "parts": {}, "table": []}

    def save():
        write_json(results, args.out / "train.json")
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
            r = table_row(row, device, timer, liger_mlp, args.quack_tuned)
        except Exception as e:  # noqa: BLE001 - recorded; the rest runs
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
        except Exception as e:  # noqa: BLE001 - recorded; the rest runs
            traceback.print_exc()
            results["parts"][row.label()] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        _free(device)
        save()
    print(f"done {elapsed()}; wrote {args.out / 'train.json'} and {args.out / 'train.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
