"""The experts forward's warp-specialized down GEMM (`experts_down_ws.py`, Gluon, Hopper) where no GPU is:
it compiles for sm_90a inside Hopper's shared memory and without register spills, and what it cannot take
is refused. Its numerics run on the GPU, in `test_experts_forward_hopper.py` (`test_the_down_kernel...`:
the block's output against float64)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe.experts_ws_compile import CUOBJDUMP, compile_in_subprocess
from swiglu_patch.kernels import experts_down_ws as ws
from swiglu_patch.kernels.rules import EXPERTS_RULES

HOPPER_RULE = next(r.config for r in EXPERTS_RULES if r.gpus and r.config.warp_specialized)
# 128x256 tiles at 3 stages (a 16-bit handoff) and 128x128 tiles at 4 (the fp32 handoff fits)
CONFIGS = [dataclasses.replace(HOPPER_RULE, down_warp_specialized=True, down_ws_block_n=256, down_ws_stages=3),
           dataclasses.replace(HOPPER_RULE, down_warp_specialized=True, down_ws_block_n=128, down_ws_stages=4)]


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_compiles_for_hopper_without_spills(config, dtype, tmp_path):
    result, usage = compile_in_subprocess(dtype, "down", config, tmp_path)
    assert result["HANDOFF_FP32"] == (config.down_ws_block_n == 128), result
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    assert " STACK:0 " in usage and " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    h, down, y = torch.randn(8, 64), torch.randn(2, 32, 64), torch.randn(8, 32)
    h, down, y = (t.to(torch.bfloat16) for t in (h, down, y))
    assert not ws.can_run(h, down, (32 * 64, 64, 1), y, False, False, CONFIGS[0])  # on CPU
    for tiles in ((64, 256, 64), (128, 136, 64), (128, 512, 64), (128, 256, 48)):
        config = dataclasses.replace(CONFIGS[0], block_m=tiles[0], down_ws_block_n=tiles[1], down_ws_block_k=tiles[2])
        with pytest.raises(ValueError, match="128-row blocks"):
            ws.make_launcher(config, 2)
    with pytest.raises(ValueError, match="at least 3 stages"):
        ws.make_launcher(dataclasses.replace(CONFIGS[0], down_ws_stages=2), 2)
    with pytest.raises(ValueError, match="over Hopper's"):  # 128x256 tiles: 4 stages and the 16-bit handoff
        ws.make_launcher(dataclasses.replace(CONFIGS[0], down_ws_stages=4), 2)
