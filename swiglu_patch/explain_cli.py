"""`swiglu-patch explain`: which kernel and config a gated GEMM call runs, and why.

Reads the dispatch table (`swiglu_patch.kernels.rules`) for a call described on the command
line; needs no GPU. Options are defined without importing torch (fast --help).
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
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch explain`'s options to `parser`."""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3",
                        help="CUDA device name as torch reports it (default: an H100), or 'cpu' for the interpreter")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--m", type=positive_int, required=True, help="tokens in the call (M)")
    parser.add_argument("--k", type=positive_int, required=True, help="hidden size (K)")
    parser.add_argument("--i", type=positive_int, required=True, help="intermediate size (I)")
    parser.add_argument("--captured", action="store_true", help="the call is captured into a CUDA graph")
    parser.add_argument("--unaligned", action="store_true",
                        help="x, the weight or the output is not 16-byte aligned for TMA")


def main(args: argparse.Namespace) -> int:
    """Print the rule walk for the call; returns 0."""
    import torch

    from .kernels.dispatch import explain

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(explain(args.gpu, dtype, args.m, args.k, args.i, args.captured, tma_aligned=not args.unaligned))
    return 0
