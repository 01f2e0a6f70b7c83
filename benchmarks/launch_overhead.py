"""Host-side cost of one call, per way of launching the fused gated GEMM, next to cuBLAS.

`host µs` is the wall time per call of many back-to-back calls on a tiny shape (GPU work of
a few µs, so the host is the bottleneck); `GPU µs` is do_bench's median on a real shape, with
the L2 flush do_bench does before each call: when the host takes longer than that flush, the
gap shows up in the GPU time, which is why launch overhead matters at mid-size M.

    python -m benchmarks.launch_overhead --out $OUT/overhead
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import triton

from benchmarks.env_info import environment
from benchmarks.shapes import SHAPES
from swiglu_patch import gated_linear, pack_gate_up
from swiglu_patch.kernels.activations import ACTIVATION_CODES
from swiglu_patch.kernels.gated_gemm import _TMA_DEFAULTS, GatedGemmConfig, default_config, gated_gemm
from swiglu_patch.kernels.gated_gemm_tma import gated_gemm_tma
from swiglu_patch.kernels.gated_gemm_tma_grid import gated_gemm_tma_grid


def ways(x, packed, out):
    m = x.shape[0]
    # the plain persistent path: the tiny shape's 2 tiles would otherwise take a tail mode
    # (the shipped split tail, or stream-K with its workspace allocation)
    tma_cfg = dataclasses.replace(_TMA_DEFAULTS[max(_TMA_DEFAULTS)], stream_k=False, split_tail=False)
    ptr_cfg = default_config(m, x.dtype)
    silu = ACTIVATION_CODES["silu"]
    return {
        "cublas x @ W.T": lambda: x @ packed.T,
        "gated_gemm pointer": lambda: gated_gemm(x, packed, "silu", out=out, config=ptr_cfg, kernel="pointer"),
        "gated_gemm_tma host descriptors": lambda: gated_gemm_tma(
            x, packed, silu, True, None, out, tma_cfg, device_descriptors=False
        ),
        "gated_gemm_tma device descriptors": lambda: gated_gemm_tma(
            x, packed, silu, True, None, out, tma_cfg, device_descriptors=True
        ),
        "gated_gemm_tma device descriptors, no ws": lambda: gated_gemm_tma(
            x, packed, silu, True, None, out, dataclasses.replace(tma_cfg, warp_specialize=False), device_descriptors=True
        ),
        "gated_gemm auto (allocates out)": lambda: gated_gemm(x, packed, "silu"),
        "gated_linear (auto)": lambda: gated_linear(x, packed, "silu"),
    }


def host_us(fn, calls: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_us_from_idle(fn, calls: int = 200) -> float:
    """Median host µs of one call started on an idle GPU: each call is timed alone after a
    synchronize, so a kernel longer than the host path cannot make launches wait on a full
    queue, and what is timed is the Python and driver time a host-bound decode step pays."""
    times = []
    for _ in range(calls + 10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times[10:])[calls // 2] * 1e6


def decode_ways(dim: int, inter: int, dt: torch.dtype) -> dict:
    """The pieces of one M=1 MLP forward as a decode step runs them, eager and patched."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from swiglu_patch.module import FusedGatedMLP
    from swiglu_patch.registry import FAMILIES

    cfg = LlamaConfig(hidden_size=dim, intermediate_size=inter)
    eager = LlamaMLP(cfg).to("cuda", dt).requires_grad_(False)
    patched = LlamaMLP(cfg).to("cuda", dt).requires_grad_(False)
    patched = FusedGatedMLP(patched, FAMILIES["llama"], "silu")
    x3 = torch.randn(1, 1, dim, device="cuda", dtype=dt)
    x2 = x3.view(1, dim)
    g = eager.gate_proj.weight
    packed = patched.gate_up_interleaved
    out = torch.empty(1, inter, device="cuda", dtype=dt)
    cfg1 = default_config(1, dt, inter, torch.cuda.current_device(), dim)  # what gated_gemm picks on this GPU
    grid_cfg = GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=2)
    return {
        "F.linear (cuBLAS) gate_proj": lambda: torch.nn.functional.linear(x3, g),
        "F.silu": lambda: torch.nn.functional.silu(x3),
        "mul": lambda: x3 * x3,
        "LlamaMLP forward (eager, 5 kernels)": lambda: eager(x3),
        "FusedGatedMLP forward (patched, 2 kernels)": lambda: patched(x3),
        "gated_linear [1, 1, K]": lambda: gated_linear(x3, packed, "silu"),
        "gated_gemm [1, K] (allocates out)": lambda: gated_gemm(x2, packed, "silu"),
        "gated_gemm [1, K], out and config given": lambda: gated_gemm(x2, packed, "silu", out=out, config=cfg1),
        "gated_gemm_tma_grid [1, K], device descriptors": lambda: gated_gemm_tma_grid(
            x2, packed, ACTIVATION_CODES["silu"], True, None, out, grid_cfg, device_descriptors=True),
        "gated_gemm_tma_grid [1, K], host descriptors": lambda: gated_gemm_tma_grid(
            x2, packed, ACTIVATION_CODES["silu"], True, None, out, grid_cfg, device_descriptors=False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead"))
    ap.add_argument("--tokens", nargs="*", type=int, default=[128, 256, 512, 2048])
    ap.add_argument("--decode-only", action="store_true", help="only the M=1 host times of an MLP forward's pieces")
    ap.add_argument("--commit", default=None, help="git commit to record (the device's copy may have no .git)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dt = torch.bfloat16
    rows = []
    with torch.inference_mode():  # as generate runs them
        for name, fn in decode_ways(4096, 14336, dt).items():
            rows.append(dict(way=name, shape="llama-3-8b", m=1, host_us_from_idle=host_us_from_idle(fn)))
            print(f"idle  llama-3-8b M=1 {name:44s} {rows[-1]['host_us_from_idle']:7.1f} us/call", flush=True)
    if args.decode_only:
        (args.out / "launch_overhead.json").write_text(json.dumps(dict(
            env=environment(torch.device("cuda"), args.commit), rows=rows), indent=1))
        return
    tiny_x = torch.randn(128, 256, device="cuda", dtype=dt)
    tiny_w = torch.randn(512, 256, device="cuda", dtype=dt)
    tiny_o = torch.empty(128, 256, device="cuda", dtype=dt)
    for name, fn in ways(tiny_x, tiny_w, tiny_o).items():
        rows.append(dict(way=name, host_us=host_us(fn)))
        print(f"host  {name:42s} {rows[-1]['host_us']:7.1f} us/call", flush=True)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    fn = ways(tiny_x, tiny_w, tiny_o)["gated_linear (auto)"]
    prof.enable()
    for _ in range(300):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    (args.out / "gated_linear_profile.txt").write_text(buf.getvalue())
    print(buf.getvalue()[-3500:])
    for shape in [s for s in SHAPES if s.name in ("llama-3.2-1b", "llama-3-8b")]:
        w = pack_gate_up(*(torch.randn(2, shape.intermediate, shape.hidden, device="cuda", dtype=dt) * 0.02))
        for m in args.tokens:
            x = torch.randn(m, shape.hidden, device="cuda", dtype=dt)
            out = torch.empty(m, shape.intermediate, device="cuda", dtype=dt)
            for name, fn in ways(x, w, out).items():
                t = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
                rows.append(dict(way=name, shape=shape.name, m=m, gpu_us=t))
                print(f"gpu   {shape.name:12s} M={m:5d} {name:42s} {t:8.1f} us", flush=True)
    (args.out / "launch_overhead.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
