"""Compile the experts' warp-specialized kernels for sm_90a without a GPU: run by
`compile_in_subprocess` (for `test_experts_dh_ws.py`, `test_experts_wgrad_ws.py`,
`test_experts_dx_ws.py` and `test_experts_gated_ws.py`) in a process without TRITON_INTERPRET,
since Gluon compiles jit functions, not the interpreter's.

    python experts_ws_compile.py DTYPE EPILOGUE CUBIN_OUT CONFIG_JSON

EPILOGUE: "silu" or "gpt_oss" (silu with gpt-oss's alpha and clamp) compiles `experts_dh_ws`'s
kernel; "wgrad_down" or "wgrad_gate_up" `experts_wgrad_ws`'s, as dW_down (A by token) or
dW_gate_up (B by token); "dx" `experts_dx_ws`'s; "gated:ACT" or "gated_preact:ACT" (ACT one of
`GATED_EPILOGUES`) the forward's `experts_gated_ws`, without or with P stored; "down" the forward's
`experts_down_ws`. CONFIG_JSON: an `ExpertsBackwardConfig`'s fields as JSON (the forward's: an `ExpertsConfig`'s).

prints {"shared": bytes, "HANDOFF_FP32": bool} and writes the cubin to CUBIN_OUT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton

from swiglu_patch.kernels import experts_dh_ws as ws
from swiglu_patch.kernels import experts_down_ws, experts_dx_ws, experts_gated_ws, experts_wgrad_ws
from swiglu_patch.kernels.configs import ExpertsConfig
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts_backward_config import ExpertsBackwardConfig
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue


# the forward kernel's epilogues by name: the heaviest math (gelu_tanh) and a clamp
GATED_EPILOGUES = {"silu": GatedEpilogue("silu"), "gelu_tanh": GatedEpilogue("gelu_tanh"),
                   "clamp_gate": GatedEpilogue("silu", limit=7.0, clamp="gate")}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_in_subprocess(dtype: torch.dtype, mode: str, config: ExpertsBackwardConfig | ExpertsConfig,
                          out_dir: Path) -> tuple[dict, str]:
    """This script run on (dtype, mode, config) in a process of its own without TRITON_INTERPRET (Gluon
    compiles jit functions, not the interpreter's): (what it printed, `cuobjdump -res-usage` of the cubin,
    "REG:168 STACK:0 SHARED:... LOCAL:0 ...": spills need stack or local memory)."""
    cubin = out_dir / "kernel.cubin"
    args = [sys.executable, __file__, str(dtype).replace("torch.", ""), mode, str(cubin),
            json.dumps(dataclasses.asdict(config))]
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = json.loads(subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout)
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return result, usage


def compile_for_hopper(config: ExpertsBackwardConfig, dtype: torch.dtype, epilogue: str):
    """The kernel compiled for sm_90a as a launch at T = 512, top-8, E = 64, K_out = 2048,
    I = 768 specializes it (16-byte-aligned pointers and sizes, unit inner strides), without a GPU."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t, top_k, e, k_out, i = 512, 8, 64, 2048, 768
    s = t * top_k
    experts_epilogue = (ExpertsEpilogue(GatedEpilogue("silu", limit=7.0), alpha=1.702) if epilogue == "gpt_oss"
                        else ExpertsEpilogue(GatedEpilogue(epilogue)))
    launch = ws.make_launcher(config, dict(experts_epilogue.constexprs(), APPROX_TANH=True), top_k, 1)
    fixed = dict(launch.constexprs, NUM_PROGRAMS=132)
    runtime = dict(dy_ptr=torch.empty(t, k_out, dtype=dtype), pairs_ptr=torch.empty(s, dtype=torch.int64),
                   blocks_ptr=torch.empty(s // 128, dtype=torch.int64), rw_ptr=torch.empty(t, top_k, dtype=dtype),
                   p_ptr=torch.empty(s, 2 * i, dtype=dtype),
                   dp_ptr=torch.empty(s, 2 * i, dtype=dtype), hw_ptr=torch.empty(s, i, dtype=dtype),
                   dw_ptr=torch.empty(s, i // ws.tile_n(config), dtype=torch.float32), NUM_PAIRS=s, NUM_BLOCKS=s // 128,
                   K_OUT=k_out, I=i, UP_SHIFT=i, NUM_EXPERTS=e, stride_dym=k_out, stride_rt=top_k, stride_rj=1,
                   stride_pm=2 * i, stride_dpm=2 * i, stride_hm=i,
                   stride_dwm=i // ws.tile_n(config))
    block = [config.block_k, ws.tile_n(config)]
    runtime["wd_desc"] = TensorDescriptor.from_tensor(torch.empty(e * k_out, i, dtype=dtype), block,
                                                      gl.NVMMASharedLayout.get_default_for(block, ws._GL_DTYPES[dtype]))
    return _compile(ws._experts_dh_ws_kernel, fixed, runtime), fixed


def compile_wgrad_for_hopper(config: ExpertsBackwardConfig, dtype: torch.dtype, which: str):
    """The weight-gradient kernel compiled for sm_90a as a launch of dW_down ("wgrad_down": dOut^T
    @ hw) or dW_gate_up ("wgrad_gate_up": dP^T @ x) at T = 512, top-8, E = 64, K = K_out = 2048,
    I = 768 specializes it, without a GPU."""
    t, top_k, e, k, i = 512, 8, 64, 2048, 768
    s = t * top_k
    a_cols, b_cols = (k, i) if which == "wgrad_down" else (2 * i, k)
    launch = experts_wgrad_ws.make_launcher(config, top_k, which == "wgrad_down", which == "wgrad_gate_up")
    fixed = dict(launch.constexprs, NUM_PROGRAMS=132)
    runtime = dict(a_ptr=torch.empty(s, a_cols, dtype=dtype), b_ptr=torch.empty(s, b_cols, dtype=dtype),
                   pairs_ptr=torch.empty(s, dtype=torch.int64), starts_ptr=torch.empty(e, dtype=torch.int64),
                   ends_ptr=torch.empty(e, dtype=torch.int64), out_ptr=torch.empty(e, a_cols, b_cols, dtype=dtype),
                   NUM_PAIRS=s, A_COLS=a_cols, B_COLS=b_cols, NUM_EXPERTS=e, stride_am=a_cols, stride_bm=b_cols,
                   stride_oe=a_cols * b_cols, stride_oa=b_cols)
    return _compile(experts_wgrad_ws._experts_wgrad_ws_kernel, fixed, runtime), fixed


def compile_dx_for_hopper(config: ExpertsBackwardConfig, dtype: torch.dtype):
    """The dX kernel compiled for sm_90a as a launch at T = 512, top-8, E = 64, K = 2048, I = 768
    specializes it, without a GPU."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t, top_k, e, k, i = 512, 8, 64, 2048, 768
    s = t * top_k
    fixed = dict(experts_dx_ws.make_launcher(config, top_k).constexprs, NUM_PROGRAMS=132)
    runtime = dict(dp_ptr=torch.empty(s, 2 * i, dtype=dtype), pairs_ptr=torch.empty(s, dtype=torch.int64),
                   blocks_ptr=torch.empty(s // 128, dtype=torch.int64), dx_ptr=torch.empty(s, k, dtype=dtype),
                   NUM_PAIRS=s, NUM_BLOCKS=s // 128, K=k, N2=2 * i, NUM_EXPERTS=e, stride_dpm=2 * i, stride_dxm=k)
    block = [config.dx_block_k, config.dx_ws_block_n]
    runtime["w_desc"] = TensorDescriptor.from_tensor(torch.empty(e * 2 * i, k, dtype=dtype), block,
                                                     gl.NVMMASharedLayout.get_default_for(block, ws._GL_DTYPES[dtype]))
    return _compile(experts_dx_ws._experts_dx_ws_kernel, fixed, runtime), fixed


def compile_gated_for_hopper(config: ExpertsConfig, dtype: torch.dtype, epilogue: str, store_preact: bool):
    """The forward's gated kernel compiled for sm_90a as a launch at T = 512, top-8, E = 64, K = 2048,
    I = 768 specializes it, without a GPU; `epilogue` names one of `GATED_EPILOGUES`."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t, top_k, e, k, i = 512, 8, 64, 2048, 768
    s = t * top_k
    experts_epilogue = ExpertsEpilogue(GATED_EPILOGUES[epilogue])
    launch = experts_gated_ws.make_launcher(config, dict(experts_epilogue.constexprs(), APPROX_TANH=True), top_k,
                                            store_preact)
    fixed = dict(launch.constexprs, NUM_PROGRAMS=132)
    runtime = dict(x_ptr=torch.empty(t, k, dtype=dtype), pairs_ptr=torch.empty(s, dtype=torch.int64),
                   blocks_ptr=torch.empty(s // 128, dtype=torch.int64), h_ptr=torch.empty(s, i, dtype=dtype),
                   p_ptr=torch.empty(s, 2 * i, dtype=dtype), NUM_PAIRS=s, NUM_BLOCKS=s // 128, K=k, I=i,
                   NUM_EXPERTS=e, stride_xm=k, stride_hm=i, stride_pm=2 * i)
    block = [config.block_n, fixed["BLOCK_K"]]
    runtime["w_desc"] = TensorDescriptor.from_tensor(torch.empty(e * 2 * i, k, dtype=dtype), block,
                                                     gl.NVMMASharedLayout.get_default_for(block, ws._GL_DTYPES[dtype]))
    return _compile(experts_gated_ws._experts_gated_ws_kernel, fixed, runtime), fixed


def compile_down_for_hopper(config: ExpertsConfig, dtype: torch.dtype):
    """The forward's down kernel compiled for sm_90a as a launch at T = 512, top-8, E = 64, K_out = 2048,
    I = 768 specializes it, without a GPU."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t, top_k, e, k_out, i = 512, 8, 64, 2048, 768
    s = t * top_k
    fixed = dict(experts_down_ws.make_launcher(config, top_k).constexprs, NUM_PROGRAMS=132)
    runtime = dict(h_ptr=torch.empty(s, i, dtype=dtype), pairs_ptr=torch.empty(s, dtype=torch.int64),
                   blocks_ptr=torch.empty(s // 128, dtype=torch.int64), rw_ptr=torch.empty(t, top_k, dtype=dtype),
                   y_ptr=torch.empty(s, k_out, dtype=dtype), NUM_PAIRS=s, NUM_BLOCKS=s // 128, K_OUT=k_out, I=i,
                   NUM_EXPERTS=e, stride_hm=i, stride_rt=top_k, stride_rj=1, stride_ym=k_out)
    block = [config.down_ws_block_n, config.down_ws_block_k]
    runtime["wd_desc"] = TensorDescriptor.from_tensor(torch.empty(e * k_out, i, dtype=dtype), block,
                                                      gl.NVMMASharedLayout.get_default_for(block, ws._GL_DTYPES[dtype]))
    return _compile(experts_down_ws._experts_down_ws_kernel, fixed, runtime), fixed


def _compile(kernel, fixed: dict, runtime: dict):
    """`kernel` compiled for sm_90a with constexprs `fixed` (num_warps among them) and the runtime
    arguments' types and 16-divisibility of `runtime`."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fixed = dict(fixed)
    num_warps = fixed.pop("num_warps")
    names = kernel.arg_names
    signature = {n: "constexpr" if n in fixed or n == "num_warps" else mangle_type(runtime[n]) for n in names}
    constexprs = {(names.index(n),): v for n, v in dict(fixed, num_warps=num_warps).items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in runtime.items()
             if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0)}
    source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


if __name__ == "__main__":
    dtype_name, epilogue, cubin_out, config_json = sys.argv[1:5]
    fields, dtype = json.loads(config_json), getattr(torch, dtype_name)
    if epilogue.startswith("gated") or epilogue == "down":
        for name in ("ws_registers", "down_ws_registers"):
            fields[name] = tuple(fields[name])
        if epilogue == "down":
            compiled, fixed = compile_down_for_hopper(ExpertsConfig(**fields), dtype)
        else:
            mode, act = epilogue.split(":")
            compiled, fixed = compile_gated_for_hopper(ExpertsConfig(**fields), dtype, act, mode == "gated_preact")
    else:
        for name in ("dh_ws_registers", "wgrad_ws_tile", "wgrad_ws_registers", "dx_ws_registers"):
            fields[name] = tuple(fields[name])
        config = ExpertsBackwardConfig(**fields)
        if epilogue == "dx":
            compiled, fixed = compile_dx_for_hopper(config, dtype)
        elif epilogue.startswith("wgrad_"):
            compiled, fixed = compile_wgrad_for_hopper(config, dtype, epilogue)
        else:
            compiled, fixed = compile_for_hopper(config, dtype, epilogue)
    with open(cubin_out, "wb") as f:
        f.write(compiled.asm["cubin"])
    print(json.dumps({"shared": compiled.metadata.shared, "HANDOFF_FP32": fixed.get("HANDOFF_FP32", True)}))
