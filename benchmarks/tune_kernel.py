"""Time every candidate config of the fused gated GEMM per (shape, M) and pick defaults per M bucket.

Each config is first checked against float64 on sampled rows (a config that is wrong is
reported and never timed), then timed with `triton.testing.do_bench` (median) next to cuBLAS
on the stacked weight (`gemm_only`) in the same run. Prints, per M bucket, the config with
the best geometric-mean ratio to `gemm_only` across shapes: the table `_DEFAULTS` in
`kernels/gated_gemm.py` is copied from that output.

    python -m benchmarks.tune_kernel --out $OUT/tune [--shapes llama-3-8b ...] [--tokens 1 16 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

from benchmarks.shapes import SHAPES, select_shapes
from swiglu_patch import pack_gate_up
from swiglu_patch.kernels.activations import ACTIVATIONS
from swiglu_patch.kernels.gated_gemm import CANDIDATE_CONFIGS, GatedGemmConfig, gated_gemm, m_bucket

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)

# TMA kernel tiles (block_n = output columns; the weight box is 2 * block_n rows), each tried
# with and without warp specialization.
TMA_CONFIGS = [
    GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),
    GatedGemmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=2),
]
# decode (M <= 64): 64-row MMA (x zero-filled by TMA), narrow weight boxes, deep pipelines
TMA_DECODE_CONFIGS = [
    GatedGemmConfig(64, 32, 128, group_m=1, num_warps=4, num_stages=6),
    GatedGemmConfig(64, 32, 256, group_m=1, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 64, 128, group_m=1, num_warps=4, num_stages=5),
    GatedGemmConfig(64, 16, 256, group_m=1, num_warps=4, num_stages=6),
]


def variants(m: int) -> list[tuple[str, dict]]:
    """(label, gated_gemm kwargs) worth timing at m tokens: tiny tiles never at prefill,
    128-row tiles never at decode."""
    out = [
        (f"ptr {c}", dict(kernel="pointer", config=c))
        for c in CANDIDATE_CONFIGS
        if not (m >= 512 and c.block_m < 64) and not (m <= 16 and c.block_m > 32)
    ]
    tma = (TMA_CONFIGS if m >= 64 else []) + (TMA_DECODE_CONFIGS if m <= 64 else [])
    out += [
        (f"tma {c}", dict(kernel="tma", config=dataclasses.replace(c, warp_specialize=ws)))
        for c in tma for ws in (False, True)
    ]
    return out


def rel_err_rows(out, x, gate, up, act, rows):
    xr = x[rows].double()
    ref = ACTIVATIONS[act](xr @ gate.double().T) * (xr @ up.double().T)
    return ((out[rows].double() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", nargs="*", default=["ptr", "tma"], help="variant label prefixes to time")
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tune"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_out = []
    for shape in select_shapes(args.shapes, SHAPES):
        k, i = shape.hidden, shape.intermediate
        gate = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        up = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        packed = pack_gate_up(gate, up)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda").to(dtype)
            rows = torch.randperm(m, device="cuda")[:64]
            t_gemm = triton.testing.do_bench(lambda: x @ packed.T, warmup=10, rep=args.rep_ms, return_mode="median")
            for label, kw in variants(m):
                if not any(label.startswith(prefix) for prefix in args.kernels):
                    continue
                out = torch.full((m, i), float("nan"), dtype=dtype, device="cuda")
                t0 = time.perf_counter()
                try:
                    gated_gemm(x, packed, shape.activation, out=out, **kw)
                    torch.cuda.synchronize()
                except Exception as e:  # out of shared memory or registers: record, go on
                    rows_out.append(dict(shape=shape.name, m=m, config=label, error=repr(e)[:300]))
                    continue
                first_call_s = time.perf_counter() - t0
                err = rel_err_rows(out, x, gate, up, shape.activation, rows)
                ok = math.isfinite(err) and err < 1e-2 and not out.isnan().any().item()
                t = float("nan")
                if ok:
                    t = triton.testing.do_bench(
                        lambda: gated_gemm(x, packed, shape.activation, out=out, **kw),
                        warmup=10, rep=args.rep_ms, return_mode="median",
                    )
                rows_out.append(dict(
                    shape=shape.name, m=m, bucket=m_bucket(m), config=label, rel_err=err, ok=ok,
                    ms=t, gemm_only_ms=t_gemm, ratio=t / t_gemm, first_call_s=first_call_s,
                ))
            best = min((r for r in rows_out if r.get("shape") == shape.name and r["m"] == m and r.get("ok")),
                       key=lambda r: r["ms"], default=None)
            if best:
                print(f"{shape.name:14s} M={m:6d} gemm_only {t_gemm*1e3:9.1f} us  best {best['ms']*1e3:9.1f} us "
                      f"ratio {best['ratio']:.3f}  {best['config']}", flush=True)
    (args.out / "tune.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        dtype=args.dtype, rows=rows_out), indent=1))

    # per M bucket: the config with the best geometric-mean ratio over the shapes measured
    by_bucket: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows_out:
        if r.get("ok"):
            by_bucket[r["bucket"]][r["config"]].append(math.log(r["ratio"]))
    errors = sorted({r["config"] + ": " + r["error"] for r in rows_out if "error" in r})
    print(f"\n{len(errors)} variants failed to run:" + "".join("\n  " + e for e in errors[:10]))
    print("\nbest config per M bucket (geometric-mean ratio to gemm_only over shapes):")
    for bucket in sorted(by_bucket):
        n_shapes = max(len(v) for v in by_bucket[bucket].values())
        scored = [(sum(v) / len(v), c) for c, v in by_bucket[bucket].items() if len(v) == n_shapes]
        score, cfg = min(scored)
        print(f"  bucket {bucket:5d}: {math.exp(score):.3f}x  {cfg}")


if __name__ == "__main__":
    main()
