"""What the L2 state before a timed call does to decode timings, and the read bandwidth.

The same calls timed three ways, interleaved where the timer allows:

- `do_bench`: triton.testing.do_bench, L2 flushed by zeroing 256 MB, no CUDA graph (the
  benchmark's method up to commit 1e89803);
- `graph, zero flush`: CUDA-graph replay after the same zeroing flush (host time removed,
  dirty L2 kept);
- `graph, read flush`: CUDA-graph replay after reading 256 MB (host time removed, L2 clean):
  `bench_mlp`'s default timer.

Also measured under each: a 1 GiB device-to-device copy by `copy_` (which a graph captures as
a copy-engine memcpy node) and by an elementwise kernel (`neg`), bytes read + written, and
a pure read (a sum over 1 GiB). Prints a table; writes OUT/l2_state.json.

    python -m benchmarks.l2_state --out $OUT/l2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.env_info import environment
from benchmarks.shapes import SHAPES, select_shapes
from benchmarks.timing import DoBenchTimer, GraphTimer
from swiglu_patch import gated_linear, pack_gate_up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/l2_state"))
    ap.add_argument("--shapes", nargs="*", default=["llama-3-8b", "qwen2.5-7b", "llama-3-70b"])
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--commit")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    timers = {
        "do_bench": DoBenchTimer(),
        "graph, zero flush": GraphTimer(flush="zero"),
        "graph, read flush": GraphTimer(flush="read"),
    }
    rows = []
    n = (1 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst, acc = torch.empty_like(src), torch.empty((), device="cuda")
    for name, timer in timers.items():
        t = timer.many({"copy_": lambda: dst.copy_(src), "neg": lambda: torch.neg(src, out=dst),
                        "read": lambda: torch.sum(src, dim=0, out=acc)})
        rows.append(dict(timer=name, what="bandwidth", copy_tbps=2 * n * 4 / t["copy_"] / 1e12,
                         neg_tbps=2 * n * 4 / t["neg"] / 1e12, read_tbps=n * 4 / t["read"] / 1e12))
        print(f"{name:20s} copy_ {rows[-1]['copy_tbps']:.3f} TB/s, neg {rows[-1]['neg_tbps']:.3f} TB/s (read + written)"
              f"  read {rows[-1]['read_tbps']:.3f} TB/s", flush=True)
    del src, dst
    for shape in select_shapes(args.shapes, SHAPES):
        k, i = shape.hidden, shape.intermediate
        stacked = torch.randn(2 * i, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        packed = pack_gate_up(stacked[:i], stacked[i:])
        weight_bytes = stacked.numel() * stacked.element_size()
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = {"ours": lambda: gated_linear(x, packed, shape.activation), "gemm_only": lambda: x @ stacked.T}
            for name, timer in timers.items():
                t = timer.many(fns)
                row = dict(timer=name, shape=shape.name, m=m, weight_bytes=weight_bytes,
                           ours_us=t["ours"] * 1e6, gemm_only_us=t["gemm_only"] * 1e6, modes=dict(timer.modes))
                rows.append(row)
                print(f"{name:20s} {shape.name:12s} M={m:3d} ours {row['ours_us']:7.1f} us "
                      f"({weight_bytes / t['ours'] / 1e12:.2f} TB/s)  gemm_only {row['gemm_only_us']:7.1f} us "
                      f"({weight_bytes / t['gemm_only'] / 1e12:.2f} TB/s)", flush=True)
        del stacked, packed
    (args.out / "l2_state.json").write_text(json.dumps(
        dict(env=environment(torch.device("cuda"), args.commit), rows=rows), indent=1))


if __name__ == "__main__":
    main()
