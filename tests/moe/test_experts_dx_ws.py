"""The experts backward's warp-specialized dX kernel (`experts_dx_ws.py`, Gluon, Hopper) where no GPU
is: it compiles for sm_90a with the Hopper rule's tiles inside Hopper's shared memory and without
register spills, and what it cannot take is refused. Its numerics run on the GPU, in
`test_experts_backward_hopper.py` (`test_the_warp_specialized_dx_kernel`: every gradient against
float64)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe.experts_ws_compile import CUOBJDUMP, compile_in_subprocess
from swiglu_patch.kernels import experts_dx_ws as ws
from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES

HOPPER_RULE = next(r for r in EXPERTS_BACKWARD_RULES if r.gpus)
# 128x256 tiles (two MMA warpgroups side by side) at 3 stages with a 16-bit handoff, and 128x128 tiles (one
# warpgroup) at 4 stages with an fp32 one
CONFIGS = [dataclasses.replace(HOPPER_RULE.config, dx_warp_specialized=True, dx_ws_block_n=256, dx_ws_stages=3),
           dataclasses.replace(HOPPER_RULE.config, dx_warp_specialized=True, dx_ws_block_n=128, dx_ws_stages=4)]


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_compiles_for_hopper_without_spills(config, dtype, tmp_path):
    result, usage = compile_in_subprocess(dtype, "dx", config, tmp_path)
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    assert " STACK:0 " in usage and " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    dp, gate_up, dx = (torch.randn(8, 128, dtype=torch.bfloat16), torch.randn(2, 128, 64, dtype=torch.bfloat16),
                       torch.randn(8, 64, dtype=torch.bfloat16))
    assert not ws.can_run(dp, gate_up, gate_up.stride(), dx, False, CONFIGS[0])  # on CPU
    for tiles in ((64, 128, 64), (128, 136, 64), (128, 192, 64)):
        config = dataclasses.replace(CONFIGS[0], block_m=tiles[0], dx_ws_block_n=tiles[1], dx_block_k=tiles[2])
        with pytest.raises(ValueError, match="128-row blocks and dx_ws_block_n a multiple of 16"):
            ws.make_launcher(config, 2)
    with pytest.raises(ValueError, match="fewer stages"):
        ws.make_launcher(dataclasses.replace(CONFIGS[0], dx_ws_stages=5), 2)


@pytest.mark.parametrize("kernel", ["experts_dh_ws", "experts_wgrad_ws", "experts_dx_ws"])
def test_every_warp_specialized_experts_kernel_refuses_a_ring_of_two_stages(kernel):
    """With 2 stages the loader (signalling a stage one step late) and the MMA group (one wgmma in flight) wait on
    each other: a hang on the GPU, so a ValueError here."""
    import importlib

    from swiglu_patch.kernels.epilogue import GatedEpilogue

    module = importlib.import_module(f"swiglu_patch.kernels.{kernel}")
    config = dataclasses.replace(HOPPER_RULE.config, dh_ws_stages=2, wgrad_num_stages=2, dx_ws_stages=2)
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), ALPHA=0.0, APPROX_TANH=False)
    with pytest.raises(ValueError, match="a ring of at least 3 stages"):
        if kernel == "experts_dh_ws":
            module.make_launcher(config, epilogue, 2, 1)
        elif kernel == "experts_wgrad_ws":
            module.make_launcher(config, 2, True, False)
        else:
            module.make_launcher(config, 2)
