"""Where a decode call's time goes: per-program start and end times of our kernel and of a pure read.

`read_floor.py` found ours 5-6 µs slower than a kernel that only reads the same weight bytes,
on the 7-9B shapes at M = 1. This script looks inside one call of each. A copy of the pointer
kernel (`_gated_gemm_fwd_kernel` with the pointer tile the GPU and shape get at M <= 16; where a
rule runs the one-token GEMV instead, that is not traced) and of the pure-read kernel record, per program, `%globaltimer` when the program starts and after its
last store, and `%smid`. From those (one call after a read-only L2 flush, the median-span of
`--calls` calls):

- `span`: last end - first start; `event`: the call's CUDA-event time (graph timer), so
  event - span is launch latency plus what follows the last program's timer read;
- `wave1`: when the last SM got its first program (every program of ours reads the same bytes);
- `tile read`: our tile's access pattern alone (`_tile_read_kernel`: the same rows per
  program, K step and warps, summing instead of the dot). Triton software-pipelines only
  loads that feed a dot, so its loads are plain and one K step deep: on the H100 it ran
  17-25% slower than ours, which tells that the cp.async stages matter, not what the pattern
  costs with them;
- `done 50/90`: when that share of the programs had finished; `tail`: last end - done 90;
- the bandwidth in each eighth of the span, from the per-program traces (kept in the JSON for
  ours and the largest pure-read block): where a kernel's drain loses its time.

The instrumented kernels are timed beside the plain ones, so what the timer reads cost shows.

    python -m benchmarks.decode_timeline --out $OUT/timeline --commit <sha> [--shapes llama-3-8b ...]
    python -m benchmarks.decode_timeline --report benchmarks/results/decode_timeline/decode_timeline_bfloat16.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.env_info import environment
from benchmarks.shapes import SHAPES, select_shapes
from benchmarks.timing import GraphTimer
from swiglu_patch import pack_gate_up
from swiglu_patch.kernels import gated_gemm as shipped_module
from swiglu_patch.kernels.activations import ACTIVATION_CODES

DEFAULT_SHAPES = ["llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "gemma-2-9b"]
READ_BLOCKS = [(8192, 4), (16384, 8)]  # (elements per program, warps) of the pure read

# appended to the copy of kernels/gated_gemm.py: its pointer kernel calls the helpers below
_HELPERS = "\nfrom benchmarks.decode_timeline import _globaltimer, _trace  # noqa: E402\n"
# (anchor in kernels/gated_gemm.py, replacement): a trace argument, a start time, the trace store
_EDITS = [
    ("    x_ptr, w_ptr, b_ptr, out_ptr,\n    M, I, K,", "    x_ptr, w_ptr, b_ptr, out_ptr, trace_ptr,\n    M, I, K,"),
    ("    # -- tile ordering: groups", "    t_begin = _globaltimer()\n    # -- tile ordering: groups"),
    ("    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_i[None, :])\n",
     "    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_i[None, :])\n"
     "    _trace(trace_ptr, t_begin)\n"),
]


def traced_pointer_module(root: Path):
    """The `gated_gemm` module of a copy of the kernels package whose pointer kernel records a trace."""
    pkg = "_timeline_kernels"
    dst = root / pkg
    shutil.copytree(Path(shipped_module.__file__).parent, dst, ignore=shutil.ignore_patterns("__pycache__"))
    path = dst / "gated_gemm.py"
    text = path.read_text()
    for anchor, new in _EDITS:
        if text.count(anchor) != 1:
            raise RuntimeError(f"decode_timeline: kernels/gated_gemm.py changed; anchor not found once: {anchor!r}")
        text = text.replace(anchor, new)
    path.write_text(text + _HELPERS)
    spec = importlib.util.spec_from_file_location(pkg, dst / "__init__.py", submodule_search_locations=[str(dst)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{pkg}.gated_gemm")


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trace(trace_ptr, t_begin):
    """trace[pid] = (start ns, end ns, SM id) of this program."""
    t_end = _globaltimer()
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    pid = tl.program_id(0)
    tl.store(trace_ptr + pid * 3, t_begin)
    tl.store(trace_ptr + pid * 3 + 1, t_end)
    tl.store(trace_ptr + pid * 3 + 2, sm.to(tl.int64))


@triton.jit
def _read_traced_kernel(src_ptr, out_ptr, trace_ptr, n, TRACE: tl.constexpr, BLOCK: tl.constexpr):
    """out[pid] = fp32 sum of src[pid * BLOCK : (pid + 1) * BLOCK]; with TRACE, trace[pid] as above."""
    if TRACE:
        t_begin = _globaltimer()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v.to(tl.float32), axis=0))
    if TRACE:
        _trace(trace_ptr, t_begin)


@triton.jit
def _tile_read_kernel(w_ptr, out_ptr, trace_ptr, K, stride_wn, TRACE: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """Our decode tile's access pattern without its math: program pid reads packed rows
    pid*ROWS .. +ROWS over all K in [ROWS, BLOCK_SIZE_K] steps (as the pointer kernel reads its
    gate and up rows) and stores their fp32 sum; with TRACE, trace[pid] as above."""
    if TRACE:
        t_begin = _globaltimer()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        acc += tl.sum(tl.load(ptrs, mask=offs_k[None, :] < K - k * BLOCK_SIZE_K, other=0.0).to(tl.float32), axis=1)
        ptrs += BLOCK_SIZE_K
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))
    if TRACE:
        _trace(trace_ptr, t_begin)


def summarize(trace: torch.Tensor, sms: int) -> dict:
    """Timeline numbers (µs from the first program's start) of one traced call."""
    t = trace.cpu().double()
    start, end = t[:, 0] - t[:, 0].min(), t[:, 1] - t[:, 0].min()
    n = len(start)
    ends = end.sort().values

    def done(q: float) -> float:
        return ends[min(n - 1, max(0, int(round(q * n)) - 1))].item() / 1e3

    t90 = done(0.9)
    starts = start.sort().values
    dur = (end - start) / 1e3
    return dict(
        programs=n, sms_used=int(t[:, 2].unique().numel()), span_us=ends[-1].item() / 1e3,
        wave1_us=starts[min(n, sms) - 1].item() / 1e3, done50_us=done(0.5), done90_us=t90, done100_us=done(1.0),
        tail_us=done(1.0) - t90,
        program_us_median=statistics.median(dur.tolist()), program_us_max=dur.max().item(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--report", type=Path, default=None,
                    help="re-render the markdown of a saved decode_timeline JSON and exit (no GPU)")
    ap.add_argument("--ncu-driver", action="store_true",
                    help="run each plain kernel once per shape and exit (for `ncu python3 -m ...`)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_timeline"))
    args = ap.parse_args()
    if args.report:
        data = json.loads(args.report.read_text())
        text = report(data, data["env"]["git"]["commit"])
        args.report.with_suffix(".md").write_text(text)
        print(text)
        return
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    timer = GraphTimer(warmup_ms=5, rep_ms=30, rounds=4)
    traced = traced_pointer_module(Path(tempfile.mkdtemp(prefix="decode_timeline_")))
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for shape in select_shapes(args.shapes, SHAPES):
        k, i = shape.hidden, shape.intermediate
        gate = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        up = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        packed = pack_gate_up(gate, up)
        nbytes = packed.numel() * packed.element_size()
        x = torch.randn(1, k, device="cuda").to(dtype)
        cfg = shipped_module.default_config(1, dtype, i, dev, k)
        if cfg.block_m == 1:  # a rule runs the GEMV at M = 1: trace the pointer tile of M <= 16
            cfg = shipped_module.default_config(16, dtype, i, dev, k)
        grid = (triton.cdiv(1, cfg.block_m) * triton.cdiv(i, cfg.block_n),)
        out = torch.empty(1, i, device="cuda", dtype=dtype)
        trace = torch.zeros(grid[0], 3, device="cuda", dtype=torch.int64)
        meta = shipped_module._launch_meta(cfg, ACTIVATION_CODES[shape.activation], True, False, "tf32")

        def ours_traced():
            traced._gated_gemm_fwd_kernel[grid](
                x, packed, packed, out, trace, 1, i, k, x.stride(0), x.stride(1),
                packed.stride(0), packed.stride(1), out.stride(0), out.stride(1), **meta)

        fns = {"ours": lambda: shipped_module.gated_gemm(x, packed, shape.activation, out=out, config=cfg),
               "ours traced": ours_traced}
        traces = {"ours traced": trace}
        ours_traced()
        ref = shipped_module.gated_gemm(x, packed, shape.activation, config=cfg)
        torch.cuda.synchronize()
        if not torch.equal(out, ref):
            raise RuntimeError(f"decode_timeline: the traced kernel's output differs from the shipped one ({shape.name})")
        n = packed.numel()
        for block, warps in READ_BLOCKS:
            rgrid = (triton.cdiv(n, block),)
            sums = torch.empty(rgrid, device="cuda", dtype=torch.float32)
            rtrace = torch.zeros(rgrid[0], 3, device="cuda", dtype=torch.int64)
            for tr in (False, True):
                name = f"read {block}/{warps}" + (" traced" if tr else "")
                fns[name] = (lambda rgrid=rgrid, sums=sums, rtrace=rtrace, tr=tr, block=block, warps=warps:
                             _read_traced_kernel[rgrid](packed, sums, rtrace, n, TRACE=tr, BLOCK=block,
                                                        num_warps=warps))
            traces[f"read {block}/{warps} traced"] = rtrace
        # our tile's rows and K step, our warps and stages, no dot
        tgrid = (2 * i // (2 * cfg.block_n),)
        tsums = torch.empty(tgrid, device="cuda", dtype=torch.float32)
        ttrace = torch.zeros(tgrid[0], 3, device="cuda", dtype=torch.int64)
        for tr in (False, True):
            fns["tile read" + (" traced" if tr else "")] = (
                lambda tr=tr: _tile_read_kernel[tgrid](packed, tsums, ttrace, k, packed.stride(0), TRACE=tr,
                                                       ROWS=2 * cfg.block_n, BLOCK_SIZE_K=cfg.block_k,
                                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        traces["tile read traced"] = ttrace
        fns["tile read"]()
        torch.cuda.synchronize()
        tile_err = abs(tsums.double().sum().item() - packed.double().sum().item()) / packed.double().abs().sum().item()
        if not tile_err < 1e-6:
            raise RuntimeError(f"decode_timeline: tile read sums off by {tile_err:.3g} ({shape.name})")
        if args.ncu_driver:  # one call of each plain kernel for the profiler, no timing
            for name in ("ours", "tile read", *(f"read {b}/{w}" for b, w in READ_BLOCKS)):
                fns[name]()
            torch.cuda.synchronize()
            continue
        event_us = {name: s * 1e6 for name, s in timer.many(fns).items()}
        row = dict(shape=shape.name, K=k, I=i, weight_mib=nbytes / 2**20, config=str(cfg), event_us=event_us,
                   timelines={})
        for name, tr in traces.items():
            runs = []
            for _ in range(args.calls):
                timer._flush()
                fns[name]()
                torch.cuda.synchronize()
                runs.append(summarize(tr, sms))
            runs.sort(key=lambda r: r["span_us"])
            row["timelines"][name] = runs[len(runs) // 2] | dict(span_us_all=[r["span_us"] for r in runs])
            if name not in ("ours traced", f"read {READ_BLOCKS[-1][0]}/{READ_BLOCKS[-1][1]} traced"):
                continue
            t = tr.cpu()
            t0 = t[:, 0].min()
            row["timelines"][name]["raw_ns"] = dict(start=(t[:, 0] - t0).tolist(), end=(t[:, 1] - t0).tolist(),
                                                    sm=t[:, 2].tolist())
        rows.append(row)
        print(f"{shape.name}: " + "  ".join(f"{n} {v:.1f}" for n, v in event_us.items()), flush=True)
    if args.ncu_driver:
        return
    env = environment(torch.device("cuda"), args.commit) | dict(dtype=args.dtype, timer=timer.describe())
    data = dict(env=env, rows=rows)
    (args.out / f"decode_timeline_{args.dtype}.json").write_text(json.dumps(data, separators=(",", ":")))  # raw traces: compact
    text = report(data, args.commit)
    (args.out / f"decode_timeline_{args.dtype}.md").write_text(text)
    print(text)


def bandwidth_by_slice(raw: dict, nbytes: float, slices: int = 8) -> list[float]:
    """TB/s in each of `slices` equal parts of a traced call's span, each program's bytes spread
    evenly over its own start..end."""
    starts, ends = raw["start"], raw["end"]
    per = nbytes / len(starts)
    span = max(ends)
    out = []
    for j in range(slices):
        t0, t1 = j * span / slices, (j + 1) * span / slices
        b = sum(per * max(0.0, min(e, t1) - max(a, t0)) / (e - a) for a, e in zip(starts, ends) if e > a)
        out.append(b / ((t1 - t0) * 1e-9) / 1e12)
    return out


def report(data: dict, commit: str) -> str:
    """The markdown tables of a run (`--report` re-renders a saved JSON)."""
    env = data["env"]
    lines = [f"# Decode timeline, M = 1 ({env['gpu']['name']}, {env['dtype']}, commit {commit})", "",
             f"Times in µs from the first program's start; event: CUDA-event time per call ({env['timer']}).", "",
             "| shape | kernel | event | event plain | programs | done50 | done90 | span | tail | program median / max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        for name, tl_ in r["timelines"].items():
            plain = name.replace(" traced", "")
            lines.append(
                f"| {r['shape']} | {name} | {r['event_us'][name]:.1f} | {r['event_us'][plain]:.1f} | {tl_['programs']} "
                f"| {tl_['done50_us']:.1f} | {tl_['done90_us']:.1f} | {tl_['span_us']:.1f} | {tl_['tail_us']:.1f} "
                f"| {tl_['program_us_median']:.1f} / {tl_['program_us_max']:.1f} |")
    lines += ["", "Bandwidth (TB/s) in each eighth of the span, each program's bytes spread over its own start..end:",
              "", "| shape | kernel | " + " | ".join(f"{j}/8" for j in range(1, 9)) + " |", "|---|---|" + "---|" * 8]
    for r in data["rows"]:
        nbytes = r["weight_mib"] * 2**20
        for name, tl_ in r["timelines"].items():
            if "raw_ns" in tl_:
                bw = bandwidth_by_slice(tl_["raw_ns"], nbytes)
                lines.append(f"| {r['shape']} | {name} | " + " | ".join(f"{v:.2f}" for v in bw) + " |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
