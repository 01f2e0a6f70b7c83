"""Sweep launch configs of the fused gated GEMM per (shape, M), against cuBLAS and against what
the rules ship: where a rule of `swiglu_patch.kernels.rules` gets its kernel and config.

    python -m benchmarks.tune --out OUT --sweep buckets [--shapes ...] [--tokens ...]  # tiles per M bucket
    python -m benchmarks.tune --out OUT --sweep decode --tokens 1 4 16 [--tp-shards]   # decode pointer tiles
    python -m benchmarks.tune --out OUT --sweep gemv --tokens 1                        # one-token GEMV tiles
    python -m benchmarks.tune --out OUT --sweep grid --tokens 2 8 16 32 64 128 --with-liger  # grid TMA tiles
    python -m benchmarks.tune --out OUT --sweep tail --tokens 256 512 1024 2048        # TMA split tail
    python -m benchmarks.tune --out OUT --sweep backward --shapes llama-3-8b           # training's backward GEMM
    python -m benchmarks.tune --out OUT --sweep backward_variants --shapes llama-3-8b  # its kernels: fused TMA, split
    python -m benchmarks.tune --out OUT --sweep preact --shapes llama-3-8b             # training's forward (P stored)
    python -m benchmarks.tune --dry-run --out /tmp/tune                                # CPU interpreter

For each shape and M, every candidate of the sweep (a kernel name and a `GatedGemmConfig`;
the sweeps are `harness/sweep_candidates.py`) runs once through its op's public entry point with `config=cfg, kernel=name`
(`harness/sweep_ops.py`: `gated_gemm`; `gated_gemm_with_preact` for `preact`; `gated_backward`
for `backward` and `backward_variants`) and is checked against float64 on sampled rows; a wrong or failing candidate
is recorded and never timed. The candidates that pass are timed together with the cuBLAS GEMM
of the same shape (`gemm_only`: x @ [Wg; Wu]^T, or dY @ Wd for `backward`) and with `shipped`,
the call with kernel="auto" (what the rules choose: `dispatch.choose` names the forward's
rule), by `harness/timing.GraphTimer`: CUDA-graph replays
after a read-only L2 flush, interleaved in rounds (with --sustained: back to back with no flush, hundreds of ms
per candidate, the GPU at its power cap as in a training loop). A call captured into a graph takes the
rules for captured calls, so `shipped` is labelled with those, and every replayed output is
checked against float64 too.

Writes OUT/tune.json (rows: shape, m, bucket, label, kernel, config, status, rel_err, ms,
gemm_only_ms, ratio; env: GPU, versions, commit; for the backward sweeps `compiled`: registers,
spills and shared memory of each compiled backward kernel) after every (shape, M) row, and
OUT/tune.md: per
(shape, M) the shipped and the best candidate's ratio to gemm_only, and per M bucket the
candidate with the best geometric-mean ratio over the shapes (what a rule's config is copied
from; the rule then cites the JSON in `sweep`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.configs import m_bucket
from swiglu_patch.provenance import environment

from .harness.accuracy import REL_ERR_BOUNDS, Reference, check_rows
from .harness.cli import Parser, UsageError, guarded, require_cuda, write_json
from .harness.shapes import DRY_RUN_SHAPES, SHAPES, TP_SHARD_SHAPES, select_shapes
from .harness.sweep_candidates import OP, SWEEP_HELP, SWEEPS, TMA_KERNELS, label
from .harness.sweep_ops import build_op

PROG = "python -m benchmarks.tune"
TOKENS = (1, 4, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 4096, 16384)
TRAIN_TOKENS = (4096, 8192)  # the default M of the training sweeps (those in OP)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

# -- the run -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for tune.json and tune.md")
    p.add_argument("--sweep", choices=sorted(SWEEPS), default="buckets",
                   help="; ".join(f"{n}: {what}" for n, what in SWEEP_HELP.items()))
    p.add_argument("--shapes", nargs="+", help="shape names (default: all of the table)")
    p.add_argument("--tp-shards", action="store_true", help="the tensor-parallel shard shapes instead")
    p.add_argument("--tokens", nargs="+", type=int, help=f"token counts M (default {' '.join(map(str, TOKENS))})")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--rep-ms", type=float, default=30.0, help="timed calls per candidate and row (ms of GPU time)")
    p.add_argument("--sustained", action="store_true",
                   help="time calls back to back with no L2 flush, 200 ms of warm-up and at least 400 ms per candidate: "
                        "the GPU at its power cap, as in a training loop")
    p.add_argument("--with-liger", action="store_true", help="time Liger's gemm_swiglu in SiLU rows too")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting shapes after this many seconds (0: none)")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton's interpreter, fp16, tiny shapes, two candidates per row: checks the pipeline")
    args = p.parse_args(argv)
    if args.tokens and min(args.tokens) < 1:
        p.error(f"--tokens must be positive, got {args.tokens}")
    table = DRY_RUN_SHAPES if args.dry_run else (TP_SHARD_SHAPES if args.tp_shards else SHAPES)
    try:
        args.shape_list = select_shapes(args.shapes, table)
    except ValueError as e:
        p.error(str(e))
    args.tokens = args.tokens or ([1, 7] if args.dry_run else list(TRAIN_TOKENS if args.sweep in OP else TOKENS))
    return args


def _dispatch(dry_run: bool):
    """The dispatcher; a dry run needs Triton's interpreter, on since before Triton was imported."""
    import triton.language as tl

    from swiglu_patch.kernels import dispatch

    if dry_run and not (dispatch.interpreting() and type(tl.cdiv).__name__ == "InterpretedFunction"):
        raise UsageError("--dry-run runs the kernels in Triton's interpreter, which must be on before Triton is "
                         "imported: run `TRITON_INTERPRET=1 python -m benchmarks.tune --dry-run ...`")
    return dispatch


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def run_row(shape, m: int, ops: dict, args, dispatch, timer, gen: torch.Generator) -> list[dict]:
    """Check and time every candidate of one (shape, M), with gemm_only and shipped."""
    x, w, stacked, act, ref = ops["x"], ops["packed"].weight, ops["stacked"], shape.activation, ops["ref"]
    k, i, dtype = shape.hidden, shape.intermediate, x.dtype
    gpu = torch.cuda.get_device_name() if x.is_cuda else "cpu"
    capability = torch.cuda.get_device_capability() if x.is_cuda else None
    captured = x.is_cuda  # the graph timer captures every call

    def shipped(kernel: str, at_m: int) -> C | None:
        """The config of the first rule for `kernel` that matches this shape at M = at_m (eager)."""
        key = dispatch.CallKey(gpu, capability, dtype, m_bucket(at_m), k, i, False)
        return next((r.config for _, r in dispatch.candidates(key) if r.kernel == kernel), None)

    n_rule, rule, cfg = dispatch.choose(gpu, dtype, m, k, i, captured=captured, capability_=capability)
    op_name = OP.get(args.sweep, "forward")
    cands = [("shipped", f"shipped: rule {n_rule} {rule.kernel} {cfg.short()}" if op_name == "forward" else
              "shipped: kernel='auto'", "auto", None)]
    picked = [(kn, c) for kn, c in SWEEPS[args.sweep](m, k, i, shipped) if c is not None]
    if args.dry_run:  # two candidates that run here
        picked = [(kn, c) for kn, c in picked if kn not in TMA_KERNELS or x.is_cuda][:2]
    cands += [("candidate", label(kn, c), kn, c) for kn, c in picked]
    idx = check_rows(m, 16, gen).to(x.device)
    op = build_op(op_name, x, w, stacked, act, ref.gated, idx, torch.Generator(device=x.device).manual_seed(m))
    bound = REL_ERR_BOUNDS[dtype]
    base = dict(shape=shape.name, m=m, bucket=m_bucket(m), K=k, I=i, activation=act, op=op_name)
    rows, fns = [], {"gemm_only": op.cublas}
    for role, name, kernel, config in cands:
        row = dict(base, label=name, role=role, kernel=kernel, config=dataclasses.asdict(config) if config else None)
        rows.append(row)
        if kernel in TMA_KERNELS and not x.is_cuda:
            row.update(status="skipped", reason="TMA kernels need a Hopper GPU")
            continue
        fn, outs = op.make(kernel, config)
        t0 = time.perf_counter()
        try:
            fn()
            _sync(x)
        except Exception as e:  # noqa: BLE001  (out of shared memory or registers, cannot run: record, go on)
            row.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        row["first_call_s"] = time.perf_counter() - t0
        err = op.error(outs)
        if hasattr(timer, "replayed_output") and timer.replayed_output(fn) is not None:  # what the graph timer times
            err = max(err, op.error(outs))
        row["rel_err"] = err
        if not err <= bound:
            row.update(status="failed", reason=f"relative error {err:.2e} > bound {bound:.1e} (or NaN in the output)")
            continue
        row["status"] = "ok"
        fns[name] = fn
        print(f"[tune]   {name}: checked, rel_err {err:.2e}, first call {row['first_call_s']:.1f} s", flush=True)
    if args.with_liger and act == "silu" and x.is_cuda and op_name == "forward":
        from .harness.ways import Operands, build

        liger = build("liger", Operands(x, stacked, ops["gate"], ops["up"], ops["packed"], act, "auto"))
        err = op.error((liger(),))
        rows.append(dict(base, label="liger", role="liger", kernel="liger", config=None, rel_err=err,
                         status="ok" if err <= bound else "failed"))
        if err <= bound:
            fns["liger"] = liger
    secs = _time_all(timer, fns, rows, x)
    if "gemm_only" not in secs:
        return rows
    t_gemm = secs["gemm_only"] * 1e3
    for row in rows:
        if row["label"] in secs:
            row.update(ms=secs[row["label"]] * 1e3, gemm_only_ms=t_gemm, ratio=secs[row["label"]] * 1e3 / t_gemm)
    return rows


def compiled_backward_kernels(ir_dir: Path | None = None) -> list[dict]:
    """Registers, spills and shared memory of every backward kernel compiled so far (Triton's
    per-function caches), and each one's TTGIR written under ir_dir (the study reads where the
    compiler put its layout conversions)."""
    from swiglu_patch.kernels import dispatch
    from swiglu_patch.kernels.rules import BACKWARD_KERNELS

    out = []
    for name in BACKWARD_KERNELS:
        for attr, fn in vars(dispatch.MODULES[name]).items():
            for entry in getattr(fn, "device_caches", {}).values():
                for n, (key, compiled) in enumerate(entry[0].items()):
                    try:
                        compiled._init_handles()
                    except Exception:  # noqa: BLE001  (not loadable here: the metadata still says the rest)
                        pass
                    meta = compiled.metadata
                    row = dict(kernel=name, function=attr, n_regs=getattr(compiled, "n_regs", None),
                               n_spills=getattr(compiled, "n_spills", None), shared=getattr(meta, "shared", None),
                               num_warps=getattr(meta, "num_warps", None), num_stages=getattr(meta, "num_stages", None),
                               maxnreg=getattr(meta, "maxnreg", None), key=str(key)[-600:])
                    if ir_dir is not None and "ttgir" in getattr(compiled, "asm", {}):
                        ir_dir.mkdir(parents=True, exist_ok=True)
                        row["ttgir"] = f"ir/{attr}_{n}.ttgir"
                        (ir_dir / f"{attr}_{n}.ttgir").write_text(compiled.asm["ttgir"])
                    out.append(row)
    return out


def _time_all(timer, fns: dict, rows: list[dict], x: torch.Tensor) -> dict[str, float]:
    """{label: seconds} of every callable timed together; if that raises, each alone, and a
    callable that still fails is recorded as an error in its row."""
    try:
        return timer.many(fns)
    except Exception:  # noqa: BLE001  (time one by one, so one bad candidate loses only itself)
        _sync(x)
    secs = {}
    for name, fn in fns.items():
        try:
            secs.update(timer.many({name: fn}))
        except Exception as e:  # noqa: BLE001
            _sync(x)
            for row in rows:
                if row["label"] == name:
                    row.update(status="error", reason=f"timing: {type(e).__name__}: {str(e)[:300]}")
    return secs


def best_per_bucket(rows: list[dict]) -> dict[int, tuple[float, str, int]]:
    """{bucket: (geometric-mean ratio to gemm_only, candidate label, rows)} over the candidates
    timed in every (shape, M) row of the bucket."""
    acc: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("ratio") and r["role"] == "candidate":
            acc[r["bucket"]][r["label"]].append(math.log(r["ratio"]))
    out = {}
    for bucket, by_label in sorted(acc.items()):
        n = max(len(v) for v in by_label.values())
        score, name = min((sum(v) / n, lab) for lab, v in by_label.items() if len(v) == n)
        out[bucket] = (math.exp(score), name, n)
    return out


def render_markdown(data: dict) -> str:
    env, rows = data["env"], data["rows"]
    git, v = env["git"], env["versions"]
    lines = [f"# Sweep `{data['sweep']}` ({data['dtype']}){' (dry run: numbers mean nothing)' if data['dry_run'] else ''}",
             "", f"- GPU: {env['gpu'].get('name')}; torch {v.get('torch')}, triton {v.get('triton')}",
             f"- commit {git['commit']} ({git['source']}); measured {env['date_utc']}", f"- timer: {data['timer']}",
             "", "| shape | M | gemm_only µs | shipped / gemm_only | best candidate / gemm_only | best candidate |",
             "|---|---|---|---|---|---|"]
    by_row: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_row[(r["shape"], r["m"])].append(r)
    for (shape, m), rs in by_row.items():
        shipped = next((r for r in rs if r["role"] == "shipped"), {})
        timed = [r for r in rs if r["role"] == "candidate" and r.get("ratio")]
        best = min(timed, key=lambda r: r["ratio"], default=None)
        gemm = next((r["gemm_only_ms"] for r in rs if r.get("gemm_only_ms")), None)
        lines.append(f"| {shape} | {m} | {gemm * 1e3:.1f} | " if gemm else f"| {shape} | {m} | – | ")
        lines[-1] += (f"{shipped['ratio']:.3f} | " if shipped.get("ratio") else "– | ") + (
            f"{best['ratio']:.3f} | {best['label']} |" if best else "– | – |")
    lines += ["", "Best candidate per M bucket (geometric mean of the ratio to gemm_only over its (shape, M) rows):",
              ""]
    for bucket, (score, name, n) in best_per_bucket(rows).items():
        lines.append(f"- bucket {bucket}: {score:.3f}x over {n} row(s): {name}")
    bad = sorted({f"- {r['label']}: {r['status']}: {r.get('reason', '')}" for r in rows
                  if r.get("status") in ("error", "failed", "skipped")})
    if bad:
        lines += ["", "Not timed:", "", *bad]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    dispatch = _dispatch(args.dry_run)
    if args.dry_run:
        from .harness.timing import CpuTimer

        device, dtype, timer = torch.device("cpu"), torch.float16, CpuTimer(reps=1)
    else:
        require_cuda(PROG)
        from .harness.timing import GraphTimer

        timer = (GraphTimer(warmup_ms=200, rep_ms=max(args.rep_ms, 400.0), rounds=3, flush="none") if args.sustained
                 else GraphTimer(warmup_ms=5, rep_ms=args.rep_ms, rounds=3))
        device, dtype = torch.device("cuda"), DTYPES[args.dtype]
        if args.with_liger:
            from .harness.ways import fast_liger_autotune

            fast_liger_autotune(5, 20)
    from swiglu_patch import pack_gate_up

    data = dict(schema=1, kind="tune", sweep=args.sweep, dtype=str(dtype).removeprefix("torch."),
                dry_run=args.dry_run, env=environment(device, args.commit), timer=timer.describe(),
                tokens=args.tokens, shapes=[s.name for s in args.shape_list], rows=[])
    gen = torch.Generator(device=device).manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    t_start = time.perf_counter()
    for shape in args.shape_list:
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            print(f"[tune] out of --budget-s: {shape.name} not measured", flush=True)
            continue
        k, i = shape.hidden, shape.intermediate
        stacked = torch.randn(2 * i, k, generator=gen, device=device, dtype=dtype).mul_(k**-0.5)
        gate, up = stacked[:i], stacked[i:]
        ops = dict(stacked=stacked, gate=gate, up=up, packed=pack_gate_up(gate, up), ref=Reference(gate, up,
                                                                                                   shape.activation))
        for m in args.tokens:
            ops["x"] = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            rows = run_row(shape, m, ops, args, dispatch, timer, cpu_gen)
            data["rows"] += rows
            timed = [r for r in rows if r["role"] == "candidate" and r.get("ratio")]
            best = min(timed, key=lambda r: r["ratio"], default=None)
            ship = next(r for r in rows if r["role"] == "shipped")
            print(f"[tune] {shape.name:14s} M={m:6d} shipped {ship.get('ratio', float('nan')):.3f}  best "
                  + (f"{best['ratio']:.3f} {best['label']}" if best else "–"), flush=True)
            if OP.get(args.sweep) == "backward":
                data["compiled"] = compiled_backward_kernels(args.out / "ir")
            write_json(data, args.out / "tune.json")
        del stacked, gate, up, ops
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_json(data, args.out / "tune.json")
    return data


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    data = run(args)
    write_json(data, args.out / "tune.json")
    (args.out / "tune.md").write_text(render_markdown(data))
    print(render_markdown(data).split("Best candidate")[1] if data["rows"] else "nothing measured")
    print(f"[tune] wrote {args.out / 'tune.json'} and tune.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
