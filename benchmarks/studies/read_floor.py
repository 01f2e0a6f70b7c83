"""What any kernel reading a decode call's weight bytes takes, next to the floor, ours and cuBLAS.

The decode floor (`roofline.py`) is weight bytes / copy bandwidth, the bandwidth taken from a
1 GiB copy. A kernel that reads one layer's 67-270 MB gate/up weight also pays its launch,
the first loads' latency and the drain, which that division does not count. So per shape, in
one interleaved run of the graph timer (read flush before every call, as `bench_mlp`):

- `read`: a Triton kernel that does nothing but read the packed weight, each program summing
  BLOCK contiguous elements into one fp32 (the best of a few BLOCK / warp counts; checked:
  the per-program sums add up to the weight's float64 sum);
- `ours`: `gated_gemm` at M = 1 with the shipped config for the GPU and shape;
- `cublas`: `x @ W.T` at M = 1 on the stacked [2*I, K] weight (`gemm_only`);
- `floor`: bytes / the copy peak of the same run.

`floor / read` is the share of the floor that reading the bytes alone reaches: a decode
kernel's `floor / ours` above it would beat a pure read.

    python -m benchmarks.read_floor --out $OUT/read_floor --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.env_info import environment
from benchmarks.roofline import measure_peaks, min_bytes
from benchmarks.shapes import SHAPES, select_shapes
from benchmarks.timing import GraphTimer
from swiglu_patch import pack_gate_up
from swiglu_patch.kernels.gated_gemm import gated_gemm

READ_VARIANTS = [(4096, 4), (8192, 4), (8192, 8), (16384, 8)]  # (BLOCK elements, num_warps)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[pid] = sum of src[pid * BLOCK : (pid + 1) * BLOCK] in fp32: reads every element once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v.to(tl.float32), axis=0))


def read_call(w: torch.Tensor, block: int, warps: int):
    """A zero-argument call reading all of w (contiguous), and its per-program output."""
    n = w.numel()
    grid = (triton.cdiv(n, block),)
    out = torch.full(grid, float("nan"), device=w.device, dtype=torch.float32)
    return (lambda: _read_kernel[grid](w, out, n, BLOCK=block, num_warps=warps)), out


def measure_shape(shape, dtype, timer, copy_tbps: float) -> dict:
    k, i = shape.hidden, shape.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(i, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    up = torch.randn(i, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    stacked, packed = torch.cat([gate, up]), pack_gate_up(gate, up)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    out = torch.empty(1, i, device="cuda", dtype=dtype)
    fns = {"ours": lambda: gated_gemm(x, packed, shape.activation, out=out),
           "cublas": lambda: x @ stacked.T}
    ref = packed.double().sum().item()
    for block, warps in READ_VARIANTS:
        fn, sums = read_call(packed, block, warps)
        fn()
        err = abs(sums.double().sum().item() - ref) / packed.double().abs().sum().item()
        if not err < 1e-6:  # nan (an unwritten program) fails too
            raise RuntimeError(f"read kernel BLOCK={block}: sums off by {err:.3g} of the weight's abs sum")
        fns[f"read BLOCK={block} warps={warps}"] = fn
    secs = timer.many(fns)
    reads = {name: s * 1e6 for name, s in secs.items() if name.startswith("read")}
    nbytes = min_bytes(1, k, i, packed.element_size())
    row = dict(shape=shape.name, K=k, I=i, weight_mib=packed.numel() * packed.element_size() / 2**20,
               floor_us=nbytes / (copy_tbps * 1e12) * 1e6, read_us=min(reads.values()), read_variants_us=reads,
               ours_us=secs["ours"] * 1e6, cublas_us=secs["cublas"] * 1e6)
    row.update(floor_over_read=row["floor_us"] / row["read_us"], floor_over_ours=row["floor_us"] / row["ours_us"],
               floor_over_cublas=row["floor_us"] / row["cublas_us"])
    return row


def render(data: dict) -> str:
    lines = [f"# Pure read of the decode weight against the floor ({data['env']['gpu']['name']}, "
             f"{data['dtype']}, commit {data['env']['git']['commit']})", "",
             f"Copy peak {data['copy_tbps']:.2f} TB/s; timer: {data['timer']}.", "",
             "| shape | weight MiB | floor µs | read µs | ours µs | cuBLAS µs | floor / read | floor / ours "
             "| floor / cuBLAS |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['shape']} | {r['weight_mib']:.0f} | {r['floor_us']:.1f} | {r['read_us']:.1f} | "
                     f"{r['ours_us']:.1f} | {r['cublas_us']:.1f} | {r['floor_over_read']:.3f} | "
                     f"{r['floor_over_ours']:.3f} | {r['floor_over_cublas']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/read_floor"))
    ap.add_argument("--commit", default=None, help="git commit to record (the device's copy may have no .git)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    timer = GraphTimer()
    peaks = measure_peaks(torch.device("cuda"), dtype, timer, 8192, 1 << 30)
    rows = []
    for shape in select_shapes(args.shapes, SHAPES):
        rows.append(measure_shape(shape, dtype, timer, peaks.copy_tbps))
        r = rows[-1]
        print(f"{r['shape']:14s} floor {r['floor_us']:7.1f}  read {r['read_us']:7.1f}  ours {r['ours_us']:7.1f}  "
              f"cublas {r['cublas_us']:7.1f}  floor/read {r['floor_over_read']:.3f}  floor/ours "
              f"{r['floor_over_ours']:.3f}", flush=True)
        torch.cuda.empty_cache()
    data = dict(env=environment(torch.device("cuda"), args.commit), dtype=args.dtype, timer=timer.describe(),
                copy_tbps=peaks.copy_tbps, read_variants=READ_VARIANTS, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_floor.json").write_text(json.dumps(data, indent=1))
    (args.out / "read_floor.md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
