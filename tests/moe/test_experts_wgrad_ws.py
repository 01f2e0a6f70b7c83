"""The experts backward's warp-specialized weight-gradient kernel (`experts_wgrad_ws.py`, Gluon,
Hopper) where no GPU is: it compiles for sm_90a, as dW_down and as dW_gate_up, with the Hopper
rule's tiles inside Hopper's shared memory and without register spills, and what it cannot take
is refused. Its numerics run on the GPU, in `test_experts_backward_hopper.py`
(`test_the_warp_specialized_weight_gradient_kernel`: every gradient against float64)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe.experts_ws_compile import CUOBJDUMP, compile_in_subprocess
from swiglu_patch.kernels import experts_wgrad_ws as ws
from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES

HOPPER_RULE = next(r for r in EXPERTS_BACKWARD_RULES if r.gpus)
# the Hopper rule's (256x128 tiles: two MMA warpgroups, a 16-bit handoff), and 128x128 tiles (one, an fp32 handoff)
# at the rule's stages and at the deepest ring beside that handoff
CONFIGS = [dataclasses.replace(HOPPER_RULE.config, wgrad_warp_specialized=True),
           dataclasses.replace(HOPPER_RULE.config, wgrad_warp_specialized=True, wgrad_ws_tile=(128, 128),
                               wgrad_num_stages=4),
           dataclasses.replace(HOPPER_RULE.config, wgrad_warp_specialized=True, wgrad_ws_tile=(128, 128))]


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype,which", [(torch.bfloat16, "wgrad_down"), (torch.bfloat16, "wgrad_gate_up"),
                                         (torch.float16, "wgrad_gate_up")])
def test_it_compiles_for_hopper_without_spills(config, dtype, which, tmp_path):
    result, usage = compile_in_subprocess(dtype, which, config, tmp_path)
    assert result["HANDOFF_FP32"] == (config.wgrad_ws_tile[0] == 128), result
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    assert " STACK:0 " in usage and " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    a, b = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    out = torch.empty(2, 64, 32, dtype=torch.bfloat16)
    assert not ws.can_run(a, b, out, out.stride(), False)  # on CPU
    for tile in ((32, 128), (128, 136), (128, 256), (512, 64)):
        config = dataclasses.replace(HOPPER_RULE.config, wgrad_ws_tile=tile)
        with pytest.raises(ValueError, match="a 64-, 128- or 256-row tile and 32 to 128 columns in steps of 16"):
            ws.make_launcher(config, 8, True, False)
    config = dataclasses.replace(HOPPER_RULE.config, wgrad_ws_tile=(128, 128), wgrad_num_stages=6, wgrad_rows=128)
    with pytest.raises(ValueError, match="fewer stages or rows"):
        ws.make_launcher(config, 8, True, False)
