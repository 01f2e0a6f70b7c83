"""The experts forward's warp-specialized gated kernel (`experts_gated_ws.py`, Gluon, Hopper) where no GPU
is: it compiles for sm_90a with the Hopper rule's tiles inside Hopper's shared memory and without
register spills (but for the one store-mode case `STACK_BYTES` names), with and without P stored, and
what it cannot take is refused. Its numerics run on
the GPU, in `test_experts_forward_hopper.py` (against float64)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe.experts_ws_compile import CUOBJDUMP, compile_in_subprocess
from swiglu_patch.kernels import experts_gated_ws as ws
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts_reference import ExpertsLayout
from swiglu_patch.kernels.rules import EXPERTS_RULES

HOPPER_RULE = next(r.config for r in EXPERTS_RULES if r.gpus and r.config.warp_specialized)
EPILOGUE = dict(GatedEpilogue.of("silu").constexprs(), ALPHA=0.0, APPROX_TANH=False)


# stack bytes allowed: none
STACK_BYTES: dict[str, int] = {}


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("mode", ["gated:silu", "gated:gelu_tanh", "gated:clamp_gate", "gated_preact:silu",
                                  "gated_preact:gelu_tanh", "gated_preact:clamp_gate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_compiles_for_hopper_without_spills(mode, dtype, tmp_path):
    result, usage = compile_in_subprocess(dtype, mode, HOPPER_RULE, tmp_path)
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    stack = int(usage.split(" STACK:")[1].split()[0])
    assert stack <= STACK_BYTES.get(mode, 0) and " LOCAL:0 " in usage, usage


def test_a_cpu_call_or_what_it_cannot_take_is_refused():
    x, gate_up = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(2, 96, 64, dtype=torch.bfloat16)
    h = torch.empty(16, 48, dtype=torch.bfloat16)
    assert not ws.can_run(x, gate_up, ExpertsLayout(), False, False, h, None, HOPPER_RULE)  # on CPU
    for tiles in ((64, 128, 64), (128, 136, 64), (128, 256, 64), (128, 128, 24)):
        config = dataclasses.replace(HOPPER_RULE, block_m=tiles[0], block_n=tiles[1], block_k=tiles[2])
        with pytest.raises(ValueError, match="128-row blocks, block_n a multiple of 16"):
            ws.make_launcher(config, EPILOGUE, 2, False)
    with pytest.raises(ValueError, match="shorter step along K"):
        ws.make_launcher(dataclasses.replace(HOPPER_RULE, ws_preact_block_k=128), EPILOGUE, 2, True)
    with pytest.raises(ValueError, match="fewer stages"):
        ws.make_launcher(dataclasses.replace(HOPPER_RULE, ws_stages=5), EPILOGUE, 2, False)


def test_a_ring_of_two_stages_is_refused():
    """With 2 stages the loader (signalling a stage one step late) and the MMA group (one step's wgmmas in flight)
    wait on each other: a hang on the GPU, so a ValueError here."""
    for store_preact, field in ((False, "ws_stages"), (True, "ws_preact_stages")):
        with pytest.raises(ValueError, match="a ring of at least 3 stages"):
            ws.make_launcher(dataclasses.replace(HOPPER_RULE, **{field: 2}), EPILOGUE, 2, store_preact)
