"""The experts backward's warp-specialized dH kernel (`experts_dh_ws.py`, Gluon, Hopper) where no GPU
is: it compiles for sm_90a with the Hopper rule's tiles inside Hopper's shared memory and without
register spills, and what it cannot take is refused. Its numerics run on the GPU, in
`test_experts_backward.py` (`test_the_warp_specialized_dh_kernel`: every gradient against float64)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe.experts_ws_compile import CUOBJDUMP, compile_in_subprocess
from swiglu_patch.kernels import experts_dh_ws as ws
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES

HOPPER_RULE = next(r for r in EXPERTS_BACKWARD_RULES if r.gpus)
# the Hopper rule's tiles with the kernel on, and with the deepest ring beside the fp32 handoff
CONFIGS = [dataclasses.replace(HOPPER_RULE.config, dh_warp_specialized=True),
           dataclasses.replace(HOPPER_RULE.config, dh_warp_specialized=True, dh_num_stages=5)]


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype,epilogue", [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh"),
                                            (torch.bfloat16, "gpt_oss")])
def test_it_compiles_for_hopper_without_spills(config, dtype, epilogue, tmp_path):
    result, usage = compile_in_subprocess(dtype, epilogue, config, tmp_path)
    assert result["HANDOFF_FP32"], result  # 128x128 tiles: the fp32 handoff fits beside 4 and 5 stages
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    assert " STACK:0 " in usage and " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    dout, down = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(2, 64, 32, dtype=torch.bfloat16)
    assert not ws.can_run(dout, down, (64 * 32, 32, 1), 32, False, False, CONFIGS[0])  # on CPU
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), ALPHA=0.0, APPROX_TANH=False)
    for tiles in ((64, 128, 64), (128, 136, 64), (128, 512, 64)):
        config = dataclasses.replace(HOPPER_RULE.config, block_m=tiles[0], block_n=tiles[1], block_k=tiles[2])
        with pytest.raises(ValueError, match="128-row blocks and a tile along I"):
            ws.make_launcher(config, epilogue, 2, 1)
