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
# the Hopper rule's tiles (128x256, 3 stages, a 16-bit handoff), and 128x128 tiles with the fp32 handoff beside 4
# and 5 stages
CONFIGS = [HOPPER_RULE.config,
           dataclasses.replace(HOPPER_RULE.config, dh_ws_block_n=None, dh_ws_stages=4, dh_ws_registers=(96, 192)),
           dataclasses.replace(HOPPER_RULE.config, dh_ws_block_n=None, dh_ws_stages=5, dh_ws_registers=(96, 192))]
# stack bytes allowed: none, but on 128x256 tiles (the MMA warps hold 128 accumulators a thread, which leaves the
# epilogue warps 96 registers) for fp16 gelu_tanh and for gpt-oss's clamped epilogue, which the kernel never runs
# on a real model (gpt-oss's experts have biases: `can_run` refuses them). Triton 3.6 (the H100 image's) spills 24
# and 136 bytes there, Triton 3.8 (torch 2.14's) 176 and 80, Triton 3.9 48 and 264.
STACK_BYTES = {(256, "float16", "gelu_tanh"): 192, (256, "bfloat16", "gpt_oss"): 320}


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype,epilogue", [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh"),
                                            (torch.bfloat16, "gpt_oss")])
def test_it_compiles_for_hopper_without_spills(config, dtype, epilogue, tmp_path):
    result, usage = compile_in_subprocess(dtype, epilogue, config, tmp_path)
    width = ws.tile_n(config)
    assert result["HANDOFF_FP32"] == (width == 128), result  # the fp32 handoff fits beside 128x128 tiles only
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    stack = int(usage.split(" STACK:")[1].split()[0])
    assert stack <= STACK_BYTES.get((width, str(dtype).replace("torch.", ""), epilogue), 0), usage
    assert " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    dout, down = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(2, 64, 32, dtype=torch.bfloat16)
    assert not ws.can_run(dout, down, (64 * 32, 32, 1), 32, False, False, CONFIGS[0])  # on CPU
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), ALPHA=0.0, APPROX_TANH=False)
    for tiles in ((64, 128, 64), (128, 136, 64), (128, 192, 64), (128, 512, 64)):
        config = dataclasses.replace(HOPPER_RULE.config, block_m=tiles[0], dh_ws_block_n=tiles[1], block_k=tiles[2])
        with pytest.raises(ValueError, match="128-row blocks and a tile along I"):
            ws.make_launcher(config, epilogue, 2, 1)
    with pytest.raises(ValueError, match="at least 3 stages"):
        ws.make_launcher(dataclasses.replace(HOPPER_RULE.config, dh_ws_stages=2), epilogue, 2, 1)
    with pytest.raises(ValueError, match="over Hopper's"):  # 128x256 tiles: 4 stages and the 16-bit handoff, 256 KiB
        ws.make_launcher(dataclasses.replace(HOPPER_RULE.config, dh_ws_stages=4), epilogue, 2, 1)
    # dh_ws_block_n unset: the one-program-per-tile kernel's block_n, whose dw_part has a column per tile
    assert ws.tile_n(dataclasses.replace(HOPPER_RULE.config, dh_ws_block_n=None)) == HOPPER_RULE.config.block_n
