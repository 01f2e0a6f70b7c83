"""Compile the experts GEMV kernels (`experts_gemv.py`, `experts_gemv_transposed.py`) for sm_90a
without a GPU, as a GPU launch specializes them: run by `test_experts_gemv.py` in a process without
TRITON_INTERPRET (the interpreter specializes nothing, so an argument Triton turns into the
constant 1 on the GPU, the interleaved layout's UP_SHIFT and the transposed layout's column
stride among them, is only exercised by compiling).

    python experts_gemv_compile.py DTYPE LAYOUT HAS_BIAS CONFIG OUT_DIR

LAYOUT: "chunked" ([gate; up], UP_SHIFT = I) or "interleaved" (UP_SHIFT = 1), for `experts_gemv.py`;
"transposed" (gpt-oss's interleaved [E, K, 2I]) for `experts_gemv_transposed.py`. CONFIG: the name
of an `ExpertsConfig` in `kernels/rules.py` (EXPERTS_GEMV_CONFIG, EXPERTS_GEMV_T2_CONFIG,
EXPERTS_GEMV_TRANSPOSED_CONFIG). Writes one cubin per kernel (gated, down; the transposed path's
down is "down" and "combine") to OUT_DIR and prints their kernel names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton


def compile_for_hopper(dtype: torch.dtype, concatenated: bool, has_bias: bool, config) -> dict:
    """Both kernels compiled for sm_90a as a launcher of `config` launches them on the Qwen3-30B-A3B
    shape at T = 1 (K = K_out = 2048, I = 768, E = 128, top-8, contiguous tensors): {name: compiled}."""
    from swiglu_patch.kernels import experts_gemv as gemv
    from swiglu_patch.kernels.epilogue import GatedEpilogue
    from swiglu_patch.kernels.experts_reference import ExpertsEpilogue

    k, i, e, top_k = 2048, 768, 128, 8
    epilogue = dict(ExpertsEpilogue(GatedEpilogue("silu")).constexprs(), APPROX_TANH=True)
    x, h, out = torch.empty(1, k, dtype=dtype), torch.empty(top_k, i, dtype=dtype), torch.empty(1, k, dtype=dtype)
    idx, w = torch.empty(1, top_k, dtype=torch.int64), torch.empty(1, top_k)
    gate_up, down = torch.empty(e, 2 * i, k, dtype=dtype), torch.empty(e, k, i, dtype=dtype)
    bias, dbias = torch.empty(e, 2 * i, dtype=dtype), torch.empty(e, k, dtype=dtype)
    launches = {
        "gated": (gemv._experts_gated_gemv_kernel, dict(
            x_ptr=x, idx_ptr=idx, w_ptr=gate_up, b_ptr=bias, h_ptr=h, K=k, I=i, UP_SHIFT=i if concatenated else 1,
            NUM_EXPERTS=e, COLUMN_BLOCKS=i // config.block_n, stride_xm=k, stride_xk=1, stride_it=top_k, stride_ij=1,
            stride_we=2 * i * k, stride_wn=k, stride_wk=1, stride_be=2 * i, stride_bn=1, stride_hm=i),
            dict(TOP_K=top_k, GATE_STEP=1 if concatenated else 2, HAS_BIAS=has_bias, **epilogue,
                 BLOCK_N=config.block_n, BLOCK_K=config.block_k)),
        "down": (gemv._experts_down_combine_kernel, dict(
            h_ptr=h, idx_ptr=idx, rw_ptr=w, d_ptr=down, db_ptr=dbias, out_ptr=out, I=i, K_OUT=k, NUM_EXPERTS=e,
            ROW_BLOCKS=k // config.down_block_n, stride_hm=i, stride_it=top_k, stride_ij=1, stride_rt=top_k,
            stride_rj=1, stride_de=k * i, stride_dn=i, stride_di=1, stride_dbe=k, stride_dbn=1, stride_om=k,
            stride_on=1),
            dict(TOP_K=top_k, SLOTS=top_k, HAS_BIAS=has_bias, BLOCK_N=config.down_block_n,
                 BLOCK_K=config.down_block_k)),
    }
    warps = {"gated": config.num_warps, "down": config.down_num_warps or config.num_warps}
    return compile_launches(launches, warps)


def compile_transposed_for_hopper(dtype: torch.dtype, has_bias: bool, config) -> dict:
    """The transposed path's three kernels compiled for sm_90a as a launcher of `config` launches
    them on the gpt-oss-20b shape at T = 1 (K = K_out = I = 2880, E = 32, top-4, interleaved
    [E, K, 2I] and [E, I, K], contiguous tensors): {name: compiled}."""
    from swiglu_patch.kernels import experts_gemv_transposed as gemv_t
    from swiglu_patch.kernels.configs import ceil_div
    from swiglu_patch.kernels.epilogue import GatedEpilogue
    from swiglu_patch.kernels.experts_reference import ExpertsEpilogue

    k, i, e, top_k = 2880, 2880, 32, 4
    epilogue = dict(ExpertsEpilogue(GatedEpilogue("silu", limit=7.0), alpha=1.702).constexprs(), APPROX_TANH=True)
    splits = ceil_div(i, config.down_split_i or i)
    x, h, out = torch.empty(1, k, dtype=dtype), torch.empty(top_k, i, dtype=dtype), torch.empty(1, k, dtype=dtype)
    idx, w = torch.empty(1, top_k, dtype=torch.int64), torch.empty(1, top_k)
    gate_up, down = torch.empty(e, k, 2 * i, dtype=dtype), torch.empty(e, i, k, dtype=dtype)
    bias, dbias = torch.empty(e, 2 * i, dtype=dtype), torch.empty(e, k, dtype=dtype)
    part = torch.empty(splits * top_k, k)
    launches = {
        "gated": (gemv_t._experts_gated_gemv_t_kernel, dict(
            x_ptr=x, idx_ptr=idx, w_ptr=gate_up, b_ptr=bias, h_ptr=h, K=k, I=i, UP_SHIFT=1, NUM_EXPERTS=e,
            COLUMN_BLOCKS=ceil_div(i, config.block_n), stride_xm=k, stride_xk=1, stride_it=top_k, stride_ij=1,
            stride_we=2 * i * k, stride_wn=1, stride_wk=2 * i, stride_be=2 * i, stride_bn=1, stride_hm=i),
            dict(TOP_K=top_k, GATE_STEP=2, HAS_BIAS=has_bias, **epilogue, BLOCK_N=config.block_n,
                 BLOCK_K=config.block_k)),
        "down": (gemv_t._experts_down_t_partial_kernel, dict(
            h_ptr=h, idx_ptr=idx, d_ptr=down, part_ptr=part, I=i, K_OUT=k, NUM_EXPERTS=e,
            ROW_BLOCKS=ceil_div(k, config.down_block_n), SPLITS=splits, SPLIT_I=config.down_split_i or i,
            PAIRS=top_k, stride_hm=i, stride_it=top_k, stride_ij=1, stride_de=i * k, stride_dn=1, stride_di=k),
            dict(TOP_K=top_k, SLOTS=top_k, BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k)),
        "combine": (gemv_t._experts_down_t_combine_kernel, dict(
            part_ptr=part, idx_ptr=idx, rw_ptr=w, db_ptr=dbias, out_ptr=out, K_OUT=k, NUM_EXPERTS=e,
            ROW_BLOCKS=ceil_div(k, gemv_t.COMBINE_BLOCK_N), SPLITS=splits, PAIRS=top_k, stride_it=top_k,
            stride_ij=1, stride_rt=top_k, stride_rj=1, stride_dbe=k, stride_dbn=1, stride_om=k, stride_on=1),
            dict(TOP_K=top_k, SLOTS=top_k, HAS_BIAS=has_bias, BLOCK_N=gemv_t.COMBINE_BLOCK_N,
                 SPLIT_CHUNK=gemv_t.COMBINE_SPLITS)),
    }
    warps = {"gated": config.num_warps, "down": config.down_num_warps or config.num_warps, "combine": 4}
    return compile_launches(launches, warps)


def compile_launches(launches: dict, warps: dict) -> dict:
    """{name: kernel compiled for sm_90a} of {name: (kernel, runtime arguments, constexprs)}, with
    the ints equal to 1 made constants and the 16-divisible ones marked, as a launch specializes them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    compiled = {}
    for name, (kernel, runtime, fixed) in launches.items():
        names = kernel.arg_names
        ones = {n: 1 for n, v in runtime.items() if v is not None and type(v) is int and v == 1}  # what Triton does
        fixed = dict(fixed, **ones)
        signature = {n: "constexpr" if n in fixed else mangle_type(runtime[n]) for n in names}
        constexprs = {(names.index(n),): v for n, v in fixed.items()}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in runtime.items()
                 if n not in fixed and (isinstance(v, torch.Tensor) or v % 16 == 0)}
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
        compiled[name] = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": warps[name], "num_stages": 1})
    return compiled


if __name__ == "__main__":
    from swiglu_patch.kernels import rules

    dtype_name, layout, has_bias, config_name, out_dir = sys.argv[1:6]
    dtype, bias, config = getattr(torch, dtype_name), bool(int(has_bias)), getattr(rules, config_name)
    if layout == "transposed":
        kernels = compile_transposed_for_hopper(dtype, bias, config)
    else:
        kernels = compile_for_hopper(dtype, layout == "chunked", bias, config)
    for name, kernel in kernels.items():
        (Path(out_dir) / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
        print(name, kernel.metadata.name)
