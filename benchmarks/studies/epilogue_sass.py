"""Count the prefill epilogue's instructions in the sm_90 SASS, per sigmoid variant; no GPU needed.

Compiles the TMA kernel (`_gated_gemm_tma_devdesc_kernel`, the shipped 128x(2x128)x64 tile,
8 warps, 4 stages, flattened loop) for sm_90 with the installed Triton and its bundled ptxas
and cuobjdump, once per sigmoid variant of `epilogue_cost.py`, and counts the instructions
between the last wgmma wait of a tile (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) and its TMA store
(`UTMASTG`): the epilogue that every thread of the two consumer warpgroups runs per tile while
the tensor cores idle. MUFU ops run 16 per clock per SM on sm_90 (CUDA programming guide,
arithmetic instruction throughput), so 2 * 64 outputs per thread * 256 threads / 16 = 2048
clocks per tile for two MUFU ops per output.

With --warp-specialize it also compiles the shipped tile with and without
`warp_specialize=True` and says whether the SASS differs, and compiles two tiles the way
Triton's Hopper warp specialization can engage (4 warps, the tile loop not flattened) to show
what it makes of them.

    python -m benchmarks.epilogue_sass [--activation silu gelu_tanh] [--warp-specialize]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.epilogue_cost import SIGMOIDS, load_variant
from swiglu_patch.kernels import gated_gemm_tma as shipped_tma
from swiglu_patch.kernels.activations import ACTIVATION_CODES

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "b_ptr": "*bf16", "ws_ptr": "*bf16",
             "cnt_ptr": "*bf16", "M": "i32", "I": "i32", "K": "i32", "dp_tiles": "i32", "stride_xm": "i32",
             "stride_wn": "i32", "stride_om": "i32"}


def compile_tile(kernel, activation: int, warp_specialize: bool = True, block_m: int = 128, block_n: int = 128,
                 num_warps: int = 8, flatten: bool = True, approx_tanh: bool = True):
    """The TMA kernel compiled for sm_90 (4 stages, 64-wide K steps); the shipped prefill tile by default."""
    const = dict(HAS_BIAS=False, ACTIVATION=activation, APPROX_TANH=approx_tanh, GATE_UP_BLOCK=16, BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n,
                 BLOCK_SIZE_K=64, GROUP_SIZE_M=8, NUM_PROGRAMS=132, WARP_SPECIALIZE=warp_specialize, FLATTEN=flatten,
                 STREAM_K=False, TAIL_SPLIT=1)
    sig = dict(SIGNATURE) | {k: "constexpr" for k in const}
    names = list(sig)
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps, "num_stages": 4})


def ws_probe(block_m: int, block_n: int) -> str:
    """What Triton's Hopper warp specialization makes of the TMA kernel when it can engage (4 warps,
    the tile loop not flattened): the number of partitions, or the compiler's failure. Compiled
    in a subprocess: a failing pass aborts the process."""
    code = (f"from benchmarks.epilogue_sass import compile_tile; from swiglu_patch.kernels import gated_gemm_tma as t; "
            f"k = compile_tile(t._gated_gemm_tma_devdesc_kernel, 0, True, {block_m}, {block_n}, 4, False); "
            f"g = k.asm['ttgir']; print('partitions', g.count('partition'), 'shared KB', k.metadata.shared // 1024)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode == 0:
        return out.stdout.strip().splitlines()[-1]
    lines = [ln for ln in (out.stderr + out.stdout).splitlines() if "unsupported" in ln or "UNREACHABLE" in ln]
    return "compile failed: " + ("; ".join(lines[:2]) or f"exit {out.returncode}")


def compile_sass(kernel, activation: int, warp_specialize: bool = True, approx_tanh: bool = True) -> list[str]:
    """SASS instruction lines (opcode and operands) of the shipped prefill tile, sm_90."""
    compiled = compile_tile(kernel, activation, warp_specialize, approx_tanh=approx_tanh)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if m:
            lines.append(m.group(1).strip())
    return lines


def epilogue_counts(sass: list[str]) -> dict:
    """Instructions and MUFU ops from the first tile's last wgmma wait to its TMA store."""
    start = next(i for i, s in enumerate(sass) if s.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    end = next(i for i in range(start, len(sass)) if "UTMASTG" in sass[i])
    body = sass[start:end]
    mufu = sum("MUFU" in s for s in body)
    return dict(instructions=len(body), mufu=mufu, mufu_clocks_per_tile=mufu * 256 // 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activation", nargs="*", default=["silu", "gelu_tanh"])
    ap.add_argument("--warp-specialize", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="epilogue_sass_"))
    # name -> (kernel, APPROX_TANH): the shipped 16-bit epilogue, then the exp sigmoid and its variants
    kernels = {"shipped": (shipped_tma._gated_gemm_tma_devdesc_kernel, True),
               "exp": (shipped_tma._gated_gemm_tma_devdesc_kernel, False)}
    for name in SIGMOIDS:
        load_variant(name, SIGMOIDS[name], tmp)
        kernels[name] = (importlib.import_module(f"_epilogue_{name}.gated_gemm_tma")._gated_gemm_tma_devdesc_kernel,
                         False)
    print(f"triton {triton.__version__}, sm_90, 128x(2x128)x64 tile, 8 warps, 4 stages\n")
    print("| sigmoid | activation | epilogue instructions per thread | MUFU per thread | MUFU clocks per tile |")
    print("|---|---|---|---|---|")
    for name, (kernel, approx) in kernels.items():
        for act in args.activation:
            c = epilogue_counts(compile_sass(kernel, ACTIVATION_CODES[act], approx_tanh=approx))
            print(f"| {name} | {act} | {c['instructions']} | {c['mufu']} | {c['mufu_clocks_per_tile']} |")
    if args.warp_specialize:
        on, off = (compile_sass(shipped_tma._gated_gemm_tma_devdesc_kernel, 0, ws) for ws in (True, False))
        print(f"\nwarp_specialize=True and False: {'identical' if on == off else 'different'} SASS "
              f"({len(on)} and {len(off)} instructions)")
        for bm, bn in ((128, 128), (64, 64)):
            print(f"forced warp specialization (4 warps, loop not flattened), {bm}x(2x{bn}) tile: {ws_probe(bm, bn)}")


if __name__ == "__main__":
    main()
