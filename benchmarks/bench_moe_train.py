"""Training one MoE experts block (forward + backward): the fused experts against transformers' paths and Liger.

    python -m benchmarks.bench_moe_train --out OUT [--shapes qwen3-30b-a3b olmoe-1b-7b] [--tokens 4096 16384]
    python -m benchmarks.bench_moe_train --dry-run --out /tmp/moe_train    # CPU, tiny shape, fp32
    python -m benchmarks.bench_moe_train --render OUT/results.json          # markdown only
    python -m benchmarks.bench_moe_train --out OUT --sweep-only --sweep-configs w4 dh64 --budget-s 420

The experts module of a real model's shape as transformers builds it (`bench_moe.build_experts`:
random bf16 weights from one seed, uniform routing), its parameters, x and the routing weights
requiring gradients. Ways, each on the same module, inputs and output gradient dOut:

- ours_store, ours_recompute: transformers calling our registered implementation
  (`swiglu_patch.experts.fused_experts_forward`, the op ``swiglu_patch::experts_train`` and its
  registered backward), saving the pairs' [T*k, 2I] pre-activation or x only;
- grouped_mm, eager: transformers' implementations (`config._experts_implementation`); eager
  only up to --eager-max tokens;
- liger: Liger-Kernel's `LigerFusedMoEFunction` (SiLU, chunked layout), when installed.

Per way and row: fwd+bwd milliseconds (CUDA events around eager calls, median:
`harness.timing.EventTimer`), TFLOP/s counted as 18*T*k*K*I (the six GEMMs of forward and
backward), saved MiB (memory allocated after the forward, less the output), peak MiB above what
was allocated before the forward, and every gradient's relative error against float64
autograd of `experts_reference` on the same inputs (the routing weights' included). The
targets (issue's step 2): fwd+bwd at least 2x grouped_mm's speed and 1.6x Liger's; store mode
saving no more than Liger; gradients within 2x grouped_mm's own error.

--sweep times our backward alone (recompute mode, every gradient) with the rule's config and
each of `--sweep-configs` (default all of `sweep_configs`), each config timed in turn beside the
rule's and checked against the rule's gradients; `--sweep-only` skips the ways. A cold Triton
cache compiles four kernels per config (tens of seconds each): pass a few configs per call and
`--budget-s`, after which no way, config or row is started (what was skipped is recorded).

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) after every way's
timing, every sweep config and every row, so a run cut by a time limit keeps what it measured,
and OUT/results.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .bench_moe import MOE_SHAPES, TINY, MoEShape, build_experts, routing
from .harness.cli import Parser, guarded, render_or_run, require_device, write_json
from .harness.fwd_bwd import grad_errors, memory_of, step_fn
from .harness.report_moe_train import GRADS, KERNEL_PRODUCTS, fmt, render_markdown

PROG = "python -m benchmarks.bench_moe_train"
SCHEMA = 1
WAYS = ("ours_store", "ours_recompute", "grouped_mm", "liger", "eager")
SHAPES = ("qwen3-30b-a3b", "olmoe-1b-7b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in MOE_SHAPES], default=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[4096, 16384])
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--eager-max", type=int, default=4096,
                   help="largest T timed on transformers' eager loop (about 0.3 s a call on these shapes)")
    p.add_argument("--reps", type=positive_int, default=10, help="timed calls per way in each of 3 rounds")
    p.add_argument("--sweep", action="store_true",
                   help="also time our backward alone (recompute mode) with each candidate config of SWEEP per row, "
                        "with each kernel's CUDA time")
    p.add_argument("--sweep-configs", nargs="+", choices=[k for k in SWEEP_NAMES if k != "rule"],
                   help="the sweep's configs beside the rule's (default all)")
    p.add_argument("--sweep-only", action="store_true", help="time only the sweep (implies --sweep), no ways")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no way, sweep config or row after this many seconds (0: no limit)")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA time of one step of each of our modes")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shape, fp32, Triton interpreter, no timing")
    p.add_argument("--render", type=Path, help="rebuild results.md from this results.json and exit")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render a results.json)")
    args.sweep = args.sweep or args.sweep_only or bool(args.sweep_configs)
    return args


def flops(shape: MoEShape, tokens: int) -> float:
    """The six GEMMs of forward and backward: 3 x (2 T k K 3I) = 18 T k K I."""
    return 18.0 * tokens * shape.top_k * shape.k * shape.i


SWEEP_NAMES = ("rule", "untuned", "first_hopper", "dh_s3", "dh64", "wg256x128", "w4", "wg_r64", "wg_r64_s3", "wg128_r64_s3",
               "wg_r32_s4", "wg_triton", "wg_ws_128", "wg_ws_r32_s6", "bm256", "dx_triton", "dx_ws_128", "dh_ws_128")


def sweep_configs() -> dict:
    """Candidate configs of our backward that --sweep times, by `SWEEP_NAMES` name (the rule's first: None):
    the planner's 128-row rule for GPUs it has no tuned rule for ("untuned"), the first Hopper rule
    ("first_hopper": 128x256 weight-gradient tiles at 2 stages over whole blocks) and that rule with one
    choice changed each (the dH kernel's stages or tile, the weight-gradient tile, 4 warps, the rows the
    weight-gradient kernels reduce per step and their stages; "wg128_r64_s3" is the Hopper rule's tiles with the
    one-program-per-tile dH kernel where the rule runs `experts_dh_ws.py`); and the Hopper rule with the weight
    gradients by the one-program-per-tile kernel ("wg_triton", where the rule runs `experts_wgrad_ws.py`), by
    `experts_wgrad_ws.py` with 128x128 tiles, and with 32 rows a step over 6 stages; "bm256": the Hopper rule on
    256-pair blocks (dH by the one-program-per-tile kernel: the warp-specialized one takes 128-pair blocks); the
    Hopper rule with dX by the one-program-per-tile kernel ("dx_triton", where the rule runs `experts_dx_ws.py` on
    128x256 tiles: "dx_ws" at 82bebf9) and by `experts_dx_ws.py` on 128x128 tiles at 4 stages ("dx_ws_128", "dx_ws" at
    8d04651); and the Hopper rule with dH by `experts_dh_ws.py` on 128x128 tiles at 4 stages with an fp32 handoff
    ("dh_ws_128", where the rule runs 128x256 tiles at 3 stages: "dh_ws_256" at f715f6b)."""
    from dataclasses import replace

    from swiglu_patch.kernels.experts_backward_config import ExpertsBackwardConfig as C
    from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES

    rule = next(r.config for r in EXPERTS_BACKWARD_RULES if r.gpus)
    hopper = C(128, 128, 64, 128, 64, 128, 256, num_warps=8, num_stages=3, dh_num_stages=4, wgrad_num_stages=2,
               smem_budget_kib=224)
    return {
        "rule": None,
        "untuned": C(128, 64, 64, 128, 64, 128, 128, num_warps=8, num_stages=3),
        "first_hopper": hopper,
        "dh_s3": replace(hopper, dh_num_stages=3),
        "dh64": replace(hopper, block_n=64),
        "wg256x128": replace(hopper, wgrad_block_a=256, wgrad_block_b=128),
        "w4": replace(hopper, num_warps=4),
        "wg_r64": replace(hopper, wgrad_rows=64),
        "wg_r64_s3": replace(hopper, wgrad_rows=64, wgrad_num_stages=3),
        "wg128_r64_s3": replace(hopper, wgrad_block_b=128, wgrad_rows=64, wgrad_num_stages=3),
        "wg_r32_s4": replace(hopper, wgrad_rows=32, wgrad_num_stages=4),
        "wg_triton": replace(rule, wgrad_warp_specialized=False),
        "wg_ws_128": replace(rule, wgrad_ws_tile=(128, 128)),
        "wg_ws_r32_s6": replace(rule, wgrad_rows=32, wgrad_num_stages=6),
        "bm256": replace(rule, block_m=256, dh_warp_specialized=False),
        "dx_triton": replace(rule, dx_warp_specialized=False),
        "dx_ws_128": replace(rule, dx_warp_specialized=True, dx_ws_block_n=128, dx_ws_stages=4),
        "dh_ws_128": replace(rule, dh_ws_block_n=None, dh_ws_stages=None, dh_ws_registers=(96, 192)),
    }


def sweep_fn(module, x, idx, w, dout, config):
    """Our backward alone (recompute mode, every gradient) with `config` (None: the rule's)."""
    from swiglu_patch.experts import experts_spec
    from swiglu_patch.kernels.experts_backward import experts_backward

    spec = experts_spec(module)
    args = (dout, x.detach(), idx, w.detach(), module.gate_up_proj.detach(), module.down_proj.detach(), spec.epilogue,
            spec.layout)

    def fn():
        return experts_backward(*args, kernel="auto" if config is None else "experts_backward_grouped", config=config)
    return fn


def max_rel_diff(ours: tuple, ref: tuple) -> float:
    """The largest relative (Frobenius) difference between two tuples of gradients (None entries skipped)."""
    return max((float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                for a, b in zip(ours, ref) if a is not None and b is not None), default=0.0)


def sweep_row(module, x, idx, w, dout, names: list[str], timer, over_budget, flush, out: dict) -> None:
    """Time the rule's backward and each named config's in turn (each beside the rule's, interleaved), each
    checked against the rule's gradients, filling `out` and calling `flush()` after each config; starts no
    config once `over_budget()`. On CPU (timer None) only the check runs.

    `out` gets {"configs": {name: {"ms", "rule_ms", "max_rel_diff_vs_rule", "config", "kernels_us"} or
    {"error"}}, "skipped": [names not started for the budget]}.
    """
    configs = sweep_configs()
    rule = sweep_fn(module, x, idx, w, dout, None)
    print("  [moe_train] sweep: compiling the rule's config", flush=True)
    ref = tuple(None if g is None else g.clone() for g in rule())
    out.update(configs={}, skipped=[])
    for name in names:
        if over_budget():
            out["skipped"].append(name)
            continue
        print(f"  [moe_train] sweep: compiling and checking {name}", flush=True)
        fn = sweep_fn(module, x, idx, w, dout, configs[name])
        try:
            diff = max_rel_diff(fn(), ref)  # compiles; a config the GPU cannot run is recorded with its error
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            out["configs"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"  sweep {name}: {out['configs'][name]['error']}", flush=True)
            flush()
            continue
        times = {"rule": None, name: None} if timer is None else timer.many({"rule": rule, name: fn})
        ms = {k: None if v is None else v * 1e3 for k, v in times.items()}
        out["configs"][name] = {"ms": ms[name], "rule_ms": ms["rule"], "max_rel_diff_vs_rule": diff,
                                "config": vars(configs[name]),
                                "kernels_us": None if timer is None else profile_of(fn, calls=5),
                                "rule_kernels_us": None if timer is None else profile_of(rule, calls=5)}
        print(f"  sweep {name}: {fmt(ms[name], '.2f')} ms (rule {fmt(ms['rule'], '.2f')}), diff vs rule "
              f"{diff:.1e}", flush=True)
        flush()


def profile_of(step, calls: int = 1) -> list:
    """[kernel name, CUDA microseconds] of each kernel one call of `step` launches, in launch order: the mean
    over `calls` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.events():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.device_type.name == "CUDA":
            kernels.append([e.name[:60], float(us)])
    per_call = len(kernels) // calls
    return [[kernels[n][0], round(sum(kernels[n + c * per_call][1] for c in range(calls)) / calls, 1)]
            for n in range(per_call)]


def leaves_of(module, x, w) -> dict:
    """The tensors that receive gradients, by `GRADS` name (biases where the module has them)."""
    leaves = {"x": x, "top_k_weights": w}
    for name in GRADS[2:]:
        p = getattr(module, name, None)
        if isinstance(p, torch.nn.Parameter):
            leaves[name] = p
    return leaves


def way_fn(name: str, module, x, idx, w):
    """A callable running one forward of way `name` on the module and inputs (None: not available)."""
    if name == "liger":
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        except ImportError:
            return None
        idx32 = idx.to(torch.int32)
        return lambda: LigerFusedMoEFunction.apply(x, module.gate_up_proj, module.down_proj, idx32, w.to(x.dtype))
    if name.startswith("ours"):
        from swiglu_patch.experts import IMPLEMENTATION, register_implementation

        register_implementation()
        impl, mode = IMPLEMENTATION, name.split("_", 1)[1]
    else:
        impl, mode = name, None

    def call():
        module.config._experts_implementation = impl
        if mode is not None:
            module.__dict__["_swiglu_experts_mode"] = mode
            module.__dict__["_swiglu_backend"] = "triton"  # the kernels (the interpreter in a dry run)
        return module(x, idx, w)
    return call


def cublas_ceilings(shape: MoEShape, tokens: int, device, dtype, timer) -> dict[str, float]:
    """Microseconds of torch.bmm for each of `KERNEL_PRODUCTS` with every expert given T k / E rows,
    contiguous (no gather, no epilogue): what cuBLAS takes for the same FLOPs, timed by `timer`."""
    rows = tokens * shape.top_k // shape.experts
    fns, keep = {}, []
    for name, (_, product) in KERNEL_PRODUCTS.items():
        m, k, n, a_t = product(shape, rows)
        a = torch.randn(shape.experts, *((k, m) if a_t else (m, k)), device=device, dtype=dtype)
        b = torch.randn(shape.experts, k, n, device=device, dtype=dtype)
        a = a.transpose(1, 2) if a_t else a
        keep.append((a, b))
        fns[name] = lambda a=a, b=b: torch.bmm(a, b)
    times = timer.many(fns)
    return {name: round(seconds * 1e6, 1) for name, seconds in times.items()}


def reference_grads(module, x, idx, w, dout) -> dict:
    """Every leaf's gradient by float64 autograd of `experts_reference`."""
    from swiglu_patch.experts import experts_spec
    from swiglu_patch.kernels.experts_reference import experts_reference

    spec = experts_spec(module)
    leaves = {k: v.detach().double().requires_grad_() for k, v in leaves_of(module, x, w).items()}
    out = experts_reference(leaves["x"], idx, leaves["top_k_weights"], leaves["gate_up_proj"], leaves["down_proj"],
                            spec.epilogue, spec.layout, leaves.get("gate_up_proj_bias"), leaves.get("down_proj_bias"))
    out.backward(dout.double())
    return {k: v.grad for k, v in leaves.items()}


def errors_of(step, leaves: dict, ref: dict) -> dict:
    """Relative error of each gradient of one step against the float64 reference."""
    step()
    return grad_errors(leaves, ref)


def targets(ways: dict) -> dict:
    """The issue's verdicts on one row (None where a comparator is missing)."""
    def get(way, key):
        return ways.get(way, {}).get(key)

    def ratio_at_least(a, b, x):
        return None if a is None or b is None else b / a >= x

    out = {}
    for mode in ("store", "recompute"):
        ours = get(f"ours_{mode}", "ms")
        out[f"{mode}: >= 2x grouped_mm's speed"] = ratio_at_least(ours, get("grouped_mm", "ms"), 2.0)
        out[f"{mode}: >= 1.6x Liger's speed"] = ratio_at_least(ours, get("liger", "ms"), 1.6)
    saved, liger_saved = get("ours_store", "saved_mib"), get("liger", "saved_mib")
    out["store: saved <= Liger's"] = None if saved is None or liger_saved is None else saved <= liger_saved
    ref = get("grouped_mm", "errors")
    for mode in ("store", "recompute"):
        errs = get(f"ours_{mode}", "errors")
        out[f"{mode}: every gradient within 2x grouped_mm's error"] = (
            None if not ref or not errs else all(errs[k] <= 2 * ref[k] for k in ref if k in errs))
    return out


def run(args: argparse.Namespace) -> dict:
    from .harness.timing import EventTimer

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    shapes = [TINY] if dry else [s for s in MOE_SHAPES if s.name in args.shapes]
    tokens_list = [5, 37] if dry else args.tokens
    timer = None if dry else EventTimer(cuda=True, reps=args.reps, rounds=3, warmup=2)
    sweep_names = args.sweep_configs or [k for k in SWEEP_NAMES if k != "rule"]
    rows = []
    data = {"kind": "moe_train", "schema": SCHEMA, "environment": environment(device, args.commit),
            "dtype": str(dtype), "timer": None if dry else timer.describe(),
            "shapes": {s.name: vars(s) for s in shapes}, "budget_s": args.budget_s, "not_started": [], "rows": rows}
    t0 = time.perf_counter()

    def over_budget() -> bool:
        return bool(args.budget_s) and time.perf_counter() - t0 > args.budget_s

    def flush() -> None:  # a run cut by its time limit keeps what it measured
        data["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(data, args.out / "results.json")

    for shape in shapes:
        module = build_experts(shape, device, dtype, args.seed).requires_grad_(True)
        for tokens in tokens_list:
            if over_budget():
                data["not_started"].append(f"{shape.name} T={tokens}")
                continue
            idx, w = routing(shape, tokens, "uniform", device, args.seed)
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, shape.k, generator=gen).to(device, dtype).requires_grad_()
            w = w.requires_grad_()
            dout = (torch.randn(tokens, shape.k, generator=gen) * shape.k ** -0.5).to(device, dtype)
            row = {"shape": shape.name, "tokens": tokens, "flops": flops(shape, tokens), "ways": {}}
            rows.append(row)
            if not args.sweep_only:
                measure_ways(row, args, shape, module, x, idx, w, dout, timer, over_budget, flush)
            if args.sweep:
                _progress(shape, tokens, f"sweep of {', '.join(sweep_names)}")
                row["sweep"] = {}
                with torch.no_grad():
                    sweep_row(module, x, idx, w, dout, sweep_names, timer, over_budget, flush, row["sweep"])
            row["targets"] = targets(row["ways"])
            flush()
            print(_line(row), flush=True)
            for name, kernels in row.get("profile_us", {}).items():
                print(f"  {name} kernels us: " + ", ".join(f"{k.lstrip('_')[:28]} {v:.0f}" for k, v in kernels), flush=True)
            del x, w, dout
        module.config._experts_implementation = "grouped_mm"
        del module
        if not dry:
            torch.cuda.empty_cache()
    return data


def measure_ways(row: dict, args, shape: MoEShape, module, x, idx, w, dout, timer, over_budget, flush) -> None:
    """Fill row["ways"]: each way's gradient errors against float64 and memory, then (on the GPU) all timed in
    turns; a way not started for the budget is recorded with that reason."""
    dry, tokens = args.dry_run, row["tokens"]
    leaves = leaves_of(module, x, w)
    _progress(shape, tokens, "float64 reference gradients")
    ref = reference_grads(module, x, idx, w, dout)
    steps = {}
    for name in args.ways:
        if (name == "eager" and tokens > args.eager_max) or (name == "liger" and (dry or shape.gpt_oss)):
            continue
        fn = way_fn(name, module, x, idx, w)
        if fn is None:
            continue
        if over_budget():
            row["ways"][name] = {"error": f"not started: --budget-s {args.budget_s:g} spent"}
            continue
        _progress(shape, tokens, f"{name}: first call (compiles, autotunes), errors, memory")
        try:
            errors = errors_of(step_fn(fn, leaves, dout), leaves, ref)
            row["ways"][name] = {"errors": errors, "max_error": max(errors.values()), **memory_of(fn, leaves, dout)}
            steps[name] = step_fn(fn, leaves, dout)
        except torch.OutOfMemoryError as e:  # a way that cannot run this row is recorded, not fatal
            row["ways"][name] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        flush()
    if not dry and steps:
        _progress(shape, tokens, f"timing {', '.join(steps)}")
        times = timer.many(steps)
        for name, seconds in times.items():
            row["ways"][name].update(ms=seconds * 1e3, tflops=row["flops"] / seconds / 1e12)
        if args.profile:
            row["profile_us"] = {name: profile_of(steps[name], calls=5) for name in steps if name.startswith("ours")}
            row["cublas_us"] = cublas_ceilings(shape, tokens, dout.device, dout.dtype, timer)
        flush()
    for t in leaves.values():
        t.grad = None


def _progress(shape: MoEShape, tokens: int, what: str) -> None:
    """One line saying where the run is (a run cut by a time limit says where it was)."""
    print(f"  [moe_train] {shape.name} T={tokens}: {what}", flush=True)


def _line(row: dict) -> str:
    sweep = " ".join(f"{k}={fmt(v.get('ms'), '.2f')}" for k, v in row.get("sweep", {}).get("configs", {}).items())
    parts = [f"{k}: {fmt(v.get('ms'), '.2f')} ms {fmt(v.get('tflops'), '.0f')} TF/s saved "
             f"{fmt(v.get('saved_mib'), '.0f')} MiB err {fmt(v.get('max_error'), '.1e')}" if "error" not in v
             else f"{k}: {v['error']}" for k, v in row["ways"].items()]
    return f"{row['shape']} T={row['tokens']}: " + " | ".join(parts) + (f" | sweep ms {sweep}" if sweep else "")


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if not args.render:
        require_device(PROG, args.dry_run)
    return render_or_run(args, "moe_train", SCHEMA, run, render_markdown)


def main(argv: list[str] | None = None) -> int:
    """The command line; a problem with the arguments or the machine is one line and exit code 2."""
    return guarded(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
