"""Compile `gated_backward_ws`'s kernel with the rules' config for sm_90a without a GPU (run by
`test_gated_backward_ws.py` in a process without TRITON_INTERPRET: Gluon compiles jit functions,
not the interpreter's).

    python ws_compile.py DTYPE ACTIVATION HAS_DH_IN CUBIN_OUT [CONFIG_JSON]

CONFIG_JSON: a `GatedGemmConfig`'s fields as JSON (default: the kernel's default config).

prints {"shared": bytes, "HANDOFF_FP32": bool} and writes the cubin to CUBIN_OUT.
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from swiglu_patch.kernels import gated_backward_ws as ws
from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.rules import DEFAULT_CONFIGS


def compile_for_hopper(config: C, dtype: torch.dtype, activation: str, has_dh_in: bool):
    """The kernel compiled for sm_90a as a launch at M = 512, K = 512, I = 1024 specializes it
    (16-byte-aligned pointers and sizes, unit inner strides), without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    m, k, i = 512, 512, 1024
    dy, wd, p, h = (torch.empty(*s, dtype=dtype) for s in ((m, k), (k, i), (m, 2 * i), (m, i)))
    gdt = ws._GL_DTYPES[dtype]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    launch = ws.make_launcher(config, dict(GatedEpilogue.of(activation).constexprs(), APPROX_TANH=True), dtype,
                              has_dh_in)
    fixed = dict(launch.constexprs, NUM_PROGRAMS=132, stride_pn=1, stride_dpn=1, stride_hi=1, stride_dhi=1)
    runtime = dict(dy_desc=TensorDescriptor.from_tensor(dy, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt)),
                   wd_desc=TensorDescriptor.from_tensor(wd, [bk, bn], gl.NVMMASharedLayout.get_default_for([bk, bn], gdt)),
                   p_ptr=p, dp_ptr=p, h_ptr=h, dh_ptr=h, M=m, I=i, K=k, stride_pm=2 * i, stride_dpm=2 * i, stride_hm=i,
                   stride_dhm=i)
    num_warps = fixed.pop("num_warps")
    names = ws._gated_backward_ws_kernel.arg_names
    signature = {n: "constexpr" if n in fixed or n == "num_warps" else mangle_type(runtime[n]) for n in names}
    constexprs = {(names.index(n),): v for n, v in dict(fixed, num_warps=num_warps).items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in runtime.items()
             if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0)}
    source = GluonASTSource(ws._gated_backward_ws_kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}), fixed



if __name__ == "__main__":
    dtype_name, activation, has_dh_in, cubin_out = sys.argv[1:5]
    config = C(**json.loads(sys.argv[5])) if len(sys.argv) > 5 else DEFAULT_CONFIGS["backward_ws"]
    compiled, fixed = compile_for_hopper(config, getattr(torch, dtype_name), activation, bool(int(has_dh_in)))
    with open(cubin_out, "wb") as f:
        f.write(compiled.asm["cubin"])
    print(json.dumps({"shared": compiled.metadata.shared, "HANDOFF_FP32": fixed["HANDOFF_FP32"]}))
