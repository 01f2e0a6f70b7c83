"""`swiglu-patch explain`: which kernel and config a call of one op runs, and why.

Reads the planner's table for the op (`swiglu_patch.kernels.rules.TABLES`, through
`swiglu_patch.kernels.dispatch.explain`) for a call described on the command line; needs no
GPU. A call the kernels refuse before any rule is read (bf16 in the CPU interpreter) is one
line on stderr and exit status 2. Options are defined without importing torch (fast --help).
"""

from __future__ import annotations

import argparse

from .inputs import positive_int

DTYPES = ("bf16", "fp16", "fp32")

EPILOG = """\
examples:
  swiglu-patch explain --m 1 --k 4096 --i 14336                 # Llama-3-8B decode on an H100
  swiglu-patch explain --gpu "NVIDIA H200" --m 8 --k 4096 --i 14336 --captured
  swiglu-patch explain --gpu cpu --dtype fp32 --m 300 --k 64 --i 72
  swiglu-patch explain --op backward --m 4096 --k 4096 --i 14336   # training's backward GEMM
  swiglu-patch explain --op forward_preact --m 4096 --k 4096 --i 14336   # training's forward (stores P)
  swiglu-patch explain --op experts --m 1 --k 2880 --i 2880 --transposed   # gpt-oss's experts at decode
  swiglu-patch explain --op experts --gpu "NVIDIA H200" --m 1024 --k 2048 --i 512 --experts 256 --top-k 8
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch explain`'s options to `parser`."""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--op", default="forward",
                        help="an op of the planner (swiglu_patch.kernels.dispatch.OPS): forward (inference's gated "
                             "GEMM, the default), forward_preact (training's: stores the pre-activation), "
                             "forward_low_rank[_preact] (with LoRA's segment), backward[_dh_in] (training's backward "
                             "GEMM), and any op family added since")
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3",
                        help="CUDA device name as torch reports it (default: an H100), or 'cpu' for the interpreter")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--m", type=positive_int, required=True, help="tokens in the call (M)")
    parser.add_argument("--k", type=positive_int, required=True, help="hidden size (K)")
    parser.add_argument("--i", type=positive_int, required=True, help="intermediate size (I)")
    parser.add_argument("--captured", action="store_true", help="the call is captured into a CUDA graph")
    parser.add_argument("--unaligned", action="store_true",
                        help="x, the weight or the output is not 16-byte aligned for TMA")
    parser.add_argument("--transposed", action="store_true",
                        help="experts ops: the weights are in the transposed layout (gpt-oss's [E, K, 2I])")
    parser.add_argument("--experts", type=positive_int, default=None,
                        help="experts ops: the experts the weights hold (with --top-k: rules on rows per expert)")
    parser.add_argument("--top-k", type=positive_int, default=None, help="experts ops: experts per token")


def main(args: argparse.Namespace) -> int:
    """Print the rule walk for the call; returns 0, or 2 with one line on stderr for a refused call."""
    import sys

    import torch

    from .kernels.dispatch import OPS, explain, refusal

    if args.op not in OPS:
        print(f"swiglu-patch explain: error: --op must be one of {', '.join(OPS)}; got {args.op!r}", file=sys.stderr)
        return 2
    if (args.experts is None) != (args.top_k is None):
        print("swiglu-patch explain: error: --experts and --top-k go together (the rows per expert need both)",
              file=sys.stderr)
        return 2
    if args.experts is not None and not args.op.startswith("experts"):
        print(f"swiglu-patch explain: error: --experts and --top-k are for the experts ops, not {args.op!r}",
              file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    why = refusal(args.gpu, dtype)
    if why is not None:
        print(f"swiglu-patch explain: error: {args.op} calls in {args.dtype} on {args.gpu} are refused at run time, "
              f"no kernel runs them: {why}", file=sys.stderr)
        return 2
    print(explain(args.gpu, dtype, args.m, args.k, args.i, args.captured, tma_aligned=not args.unaligned,
                  op=args.op, transposed=args.transposed,
                  experts=None if args.experts is None else (args.experts, args.top_k)))
    return 0
