"""Benchmark the fused gated GEMM against cuBLAS, HF eager, torch.compile and Liger.

    python -m benchmarks.bench_mlp --out OUT [--dtype bf16 fp16] [--shapes ...] [--ms ...]
    python -m benchmarks.bench_mlp --render OUT/results.json      # markdown + PNG, CPU only
    python -m benchmarks.bench_mlp --render a.json b.json --out DIR   # merge runs (e.g. bf16 + fp16)
    python -m benchmarks.bench_mlp --dry-run --out /tmp/x          # tiny shapes on CPU, seconds

For each dtype, shape (`harness/shapes.py`) and token count M, every way (`harness/ways.py`)
is first run once and checked against a float64 reference on a few rows (`harness/accuracy.py`);
a way above its dtype's error bound is marked failed and not timed. The others are timed
together (`harness/timing.py`: by default CUDA-graph replays after a read-only L2 flush, the
ways interleaved in rounds; `--timer do_bench` for triton's do_bench). The floor
(`harness/roofline.py`) uses peaks measured at the start of each dtype in the same run.

Writes OUT/results.json (after every shape, so a run cut short keeps what it measured),
OUT/results.md and OUT/mlp_<dtype>.png, and prints a short table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from swiglu_patch.provenance import environment

from .harness.accuracy import REL_ERR_BOUNDS, Reference, check_rows, rel_error
from .harness.cli import Parser, UsageError, guarded, read_json, require_cuda, sanitize, write_json
from .harness.report_mlp import GOALS, merge_results, render, summary_lines
from .harness.roofline import Peaks, floor_seconds, gated_flops, measure_peaks, min_bytes
from .harness.shapes import DRY_RUN_SHAPES, DRY_RUN_TOKENS, SHAPES, TOKENS, MLPShape, select_shapes
from .harness.timing import TIMERS, CpuTimer, gpu_timer
from .harness.ways import WAY_NAMES, CompiledEager, Operands, build, fast_liger_autotune, output_kind, unavailable

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
SCHEMA = 1
PROG = "python -m benchmarks.bench_mlp"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split(values: list[str] | None) -> list[str] | None:
    """Accept both `--x a b` and `--x a,b`."""
    return None if values is None else [v for item in values for v in item.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (required to measure; with --render, default: the JSON's folder)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], help=f"one or more of {', '.join(DTYPES)}")
    p.add_argument("--shapes", nargs="+", help="shape names (default: all); see benchmarks/harness/shapes.py")
    p.add_argument("--ms", nargs="+", help="token counts M (default: 1, 2, 4, ..., 16384)")
    p.add_argument("--ways", nargs="+", help=f"subset of {', '.join(WAY_NAMES)} (default: all)")
    p.add_argument("--timer", default="graph", choices=TIMERS,
                   help="graph: CUDA-graph replay after a read-only L2 flush, ways interleaved (default); "
                        "do_bench: triton's do_bench, zeroing flush, no graph")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="untimed calls per way and row (ms of GPU time)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="timed calls per way and row (ms of GPU time)")
    p.add_argument("--rounds", type=int, default=4, help="graph timer: rounds the ways take turns in")
    p.add_argument("--check-rows", type=int, default=8, help="output rows checked against float64 per row")
    p.add_argument("--liger-tune-ms", type=float, nargs=2, default=[5.0, 20.0], metavar=("WARMUP", "REP"),
                   help="do_bench warmup/rep Liger's autotuner uses per config; 0 0 keeps Liger's own (25, 100)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting new rows after this many seconds and write what was measured (0: no limit)")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--backend", default=None, help="gated_linear backend for ours (default auto; torch in --dry-run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, ways without torch_compile/liger unless named: checks the pipeline")
    p.add_argument("--render", type=Path, nargs="+", metavar="RESULTS_JSON",
                   help="only rebuild results.md and the PNGs from results JSON(s), into --out (default: the "
                        "JSON's folder); several are merged into one report and --out/results.json")
    args = p.parse_args(argv)
    args.dtype, args.shapes, args.ways = _split(args.dtype), _split(args.shapes), _split(args.ways)
    try:
        args.ms = [int(m) for m in _split(args.ms)] if args.ms else None
    except ValueError:
        p.error(f"--ms takes integer token counts, got {args.ms}")
    if args.out is None and not args.render:
        p.error("--out is required: the folder for results.json, results.md and the plots")
    if args.shapes:
        try:
            select_shapes(args.shapes, DRY_RUN_SHAPES if args.dry_run else SHAPES)
        except ValueError as e:
            p.error(str(e))
    bad = [d for d in args.dtype if d not in DTYPES]
    if bad:
        p.error(f"unknown --dtype {', '.join(bad)}; known: {', '.join(DTYPES)}")
    if args.ways and any(w not in WAY_NAMES for w in args.ways):
        p.error(f"unknown --ways {args.ways}; known: {', '.join(WAY_NAMES)}")
    if args.ms and min(args.ms) < 1:
        p.error("--ms must be positive token counts")
    return args


def run_row(
    way_list: list[str], ops: Operands, ref: Reference, compiled: CompiledEager | None,
    skip: dict[str, str], timer, bound: float, n_check: int, gen: torch.Generator,
) -> dict[str, dict]:
    """Check every way on one (shape, M), then time those that passed together. Returns {way: result dict}."""
    m = ops.x.shape[0]
    idx = check_rows(m, n_check, gen).to(ops.x.device)
    x_rows = ops.x.index_select(0, idx)
    refs = {"gated": ref.gated(x_rows)}
    if "gemm_only" in way_list:
        refs["preact"] = ref.preact(x_rows)
    results: dict[str, dict] = {}
    fns = {}
    for way in way_list:
        if way in skip:
            results[way] = {"status": "skipped", "reason": skip[way]}
            continue
        try:
            fn = build(way, ops, compiled)
            t0 = time.perf_counter()
            out = fn()
            if ops.x.is_cuda:
                torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            err = rel_error(out.index_select(0, idx), refs[output_kind(way)])
            del out
            if not err <= bound:
                results[way] = {"status": "failed", "rel_err": err, "setup_s": setup_s,
                                "reason": f"relative error {err:.2e} > bound {bound:.1e}"}
                continue
            replayed = getattr(timer, "replayed_output", None)
            out = replayed(fn) if replayed is not None and ops.x.is_cuda else None
            if out is not None:  # the graph timer times a replay: check what the replay computes too
                err_graph = rel_error(out.index_select(0, idx), refs[output_kind(way)])
                del out
                if not err_graph <= bound:
                    results[way] = {"status": "failed", "rel_err": err, "rel_err_graph": err_graph,
                                    "setup_s": setup_s,
                                    "reason": f"graph replay: relative error {err_graph:.2e} > bound {bound:.1e}"}
                    continue
                results[way] = {"status": "ok", "rel_err": err, "rel_err_graph": err_graph, "setup_s": setup_s}
            else:
                results[way] = {"status": "ok", "rel_err": err, "setup_s": setup_s}
            fns[way] = fn
        except Exception as e:  # noqa: BLE001  (one way failing must not stop the others)
            results[way] = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            _recover(ops.x)
    try:
        seconds = timer.many(fns)
    except Exception:  # noqa: BLE001  (time one by one, so one bad way loses only itself)
        _recover(ops.x)
        seconds = {}
        for way, fn in fns.items():
            try:
                seconds.update(timer.many({way: fn}))
            except Exception as e1:  # noqa: BLE001
                results[way] = {"status": "error", "reason": f"timing: {type(e1).__name__}: {str(e1)[:300]}"}
                _recover(ops.x)
    for way, s in seconds.items():
        results[way]["us"] = s * 1e6
        results[way]["timer_mode"] = timer.modes.get(way, "")
    return results


def _recover(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_shape(shape: MLPShape, dtype: torch.dtype, ms: list[int], way_list: list[str], peaks: Peaks,
              args: argparse.Namespace, device: torch.device, timer, deadline: float | None) -> list[dict]:
    """All rows of one shape in one dtype."""
    k, i, act = shape.hidden, shape.intermediate, shape.activation
    gen = torch.Generator(device=device).manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    stacked = torch.randn(2 * i, k, generator=gen, device=device, dtype=dtype).mul_(k**-0.5)  # [Wg; Wu]
    gate, up = stacked[:i], stacked[i:]
    skip = {w: r for w in way_list if (r := unavailable(w, act, device))}
    packed = None
    if "ours" not in skip:
        from swiglu_patch import pack_gate_up

        packed = pack_gate_up(gate, up)
    ref = Reference(gate, up, act)
    compiled = CompiledEager(act, len(ms)) if "torch_compile" in way_list and "torch_compile" not in skip else None
    rows = []
    for m in ms:
        row = {"dtype": dtype_name(dtype), "shape": shape.name, "M": m, "K": k, "I": i, "activation": act,
               "flops": gated_flops(m, k, i), "min_bytes": min_bytes(m, k, i, stacked.element_size())}
        row["floor_us"] = floor_seconds(row["flops"], row["min_bytes"], peaks) * 1e6
        if deadline is not None and time.perf_counter() > deadline:
            row["ways"] = {w: {"status": "skipped", "reason": "out of --budget-s"} for w in way_list}
        else:
            x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            ops = Operands(x, stacked, gate, up, packed, act, args.backend)
            row["ways"] = run_row(way_list, ops, ref, compiled, skip, timer, REL_ERR_BOUNDS[dtype],
                                  args.check_rows, cpu_gen)
            del x, ops
        rows.append(row)
    del stacked, gate, up, packed, ref, compiled
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _save(data: dict, out: Path) -> Path:
    return write_json(data, out / "results.json")


def run(args: argparse.Namespace) -> dict:
    """Measure everything `args` selects; write results.json as it goes. Returns the data."""
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s > 0 else None
    if args.dry_run:
        device, timer = torch.device("cpu"), CpuTimer(3)
        shapes, ms = select_shapes(args.shapes, DRY_RUN_SHAPES), args.ms or list(DRY_RUN_TOKENS)
        way_list = args.ways or ["ours", "gemm_only", "hf_eager"]
        args.backend = args.backend or "torch"
        matmul_n, copy_bytes = 256, 8 << 20
    else:
        require_cuda(PROG)
        device, timer = torch.device("cuda"), gpu_timer(args.timer, args.warmup_ms, args.rep_ms, args.rounds)
        shapes, ms = select_shapes(args.shapes), args.ms or list(TOKENS)
        way_list = args.ways or list(WAY_NAMES)
        args.backend = args.backend or "auto"
        matmul_n, copy_bytes = 8192, 1 << 30
    liger_tuning = "liger's own (do_bench warmup 25 ms, rep 100 ms)"
    if "liger" in way_list and device.type == "cuda" and unavailable("liger", "silu", device) is None:
        if all(args.liger_tune_ms) and fast_liger_autotune(*args.liger_tune_ms):
            liger_tuning = f"do_bench warmup {args.liger_tune_ms[0]:g} ms, rep {args.liger_tune_ms[1]:g} ms per config"
    dtypes = [DTYPES[d] for d in dict.fromkeys(args.dtype)]
    data = {
        "schema": SCHEMA,
        "kind": "bench_mlp",
        "env": environment(device, args.commit),
        "settings": {
            "timer": timer.describe(), "check_rows": args.check_rows, "seed": args.seed, "ours_backend": args.backend,
            "liger_autotune": liger_tuning, "budget_s": args.budget_s, "dry_run": args.dry_run,
            "rel_err_bounds": {dtype_name(d): REL_ERR_BOUNDS[d] for d in dtypes},
            "inputs": "x ~ N(0, 1); Wg, Wu ~ N(0, 1/K), so pre-activations are ~N(0, 1)",
            "goals": [g.text for g in GOALS],
        },
        "shapes": [dataclasses.asdict(s) for s in shapes],
        "ways": way_list,
        "ms": ms,
        "peaks": {},
        "rows": [],
    }
    for dtype in dtypes:
        peaks = measure_peaks(device, dtype, timer, matmul_n, copy_bytes)
        data["peaks"][dtype_name(dtype)] = peaks.to_dict()
        print(f"[bench_mlp] {dtype_name(dtype)} peaks: matmul {peaks.matmul_tflops:.3g} TFLOP/s, "
              f"copy {peaks.copy_tbps:.3g} TB/s", flush=True)
        for shape in shapes:
            t0 = time.perf_counter()
            data["rows"] += run_shape(shape, dtype, ms, way_list, peaks, args, device, timer, deadline)
            data["wall_s"] = round(time.perf_counter() - t_start, 1)
            _save(data, args.out)
            print(f"[bench_mlp] {dtype_name(dtype)} {shape.name}: {time.perf_counter() - t0:.1f} s "
                  f"(total {data['wall_s']:.0f} s)", flush=True)
    return sanitize(data)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.render:
        if len(args.render) > 1 and args.out is None:
            raise UsageError("--render with several JSONs needs --out for the merged report")
        try:
            data = merge_results([read_json(p) for p in args.render])
        except ValueError as e:
            raise UsageError(str(e)) from None
        out = args.out or args.render[0].parent
        paths = render(data, out)
        if len(args.render) > 1:
            paths.insert(0, _save(data, out))
        for path in paths:
            print(f"[bench_mlp] wrote {path}")
        return 0
    data = run(args)
    paths = [_save(data, args.out), *render(data, args.out)]
    print("\n".join(summary_lines(data)))
    for line in render_goal_summary(data):
        print(line)
    for path in paths:
        print(f"[bench_mlp] wrote {path}")
    return 0


def render_goal_summary(data: dict) -> list[str]:
    """One line per goal: how many applicable rows met it."""
    lines = []
    for g in GOALS:
        verdicts = [v for v in (g.judge(r)[0] for r in data["rows"]) if v]
        lines.append(f"[goal] {g.text}: met {verdicts.count('met')} / {len(verdicts)}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
