"""The warp-specialized backward kernel (`gated_backward_ws.py`, Gluon, Hopper) where no GPU is: it
compiles for sm_90a with each of the rules' configs inside Hopper's shared memory and without
register spills, and a call it cannot take is refused by name. Its numerics run on the GPU, in
`test_gated_backward_variants.py` (every shape, epilogue, dtype and dh_in against float64)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from swiglu_patch.kernels import gated_backward_ws as ws
from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.dispatch import gated_backward
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.rules import BACKWARD_RULES, DEFAULT_CONFIGS

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
WS_RULES = [r for r in BACKWARD_RULES if r.kernel == "backward_ws"]
RULE = WS_RULES[0]
# the configs the rules run, up to group_m (the order of the tiles, an integer constexpr: the same registers and
# shared memory)
WS_CONFIGS = list(dict.fromkeys(dataclasses.replace(r.config, group_m=8) for r in WS_RULES))


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("config", WS_CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype,activation,has_dh_in", [(torch.bfloat16, "silu", False),
                                                          (torch.float16, "gelu_tanh", True)])
def test_rule_configs_compile_for_hopper_without_spills(config, dtype, activation, has_dh_in, tmp_path):
    # Gluon compiles jit functions, not the interpreter's: a process of its own, without TRITON_INTERPRET
    env = dict(os.environ, TRITON_INTERPRET="0")
    args = [sys.executable, str(Path(__file__).with_name("ws_compile.py")), str(dtype).replace("torch.", ""),
            activation, str(int(has_dh_in)), str(tmp_path / "kernel.cubin"), json.dumps(dataclasses.asdict(config))]
    result = json.loads(subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout)
    # 128x128 tiles: 5 stages leave room for the fp32 handoff; 256x128 tiles: 3 stages and a 16-bit one
    assert result["HANDOFF_FP32"] == (config.block_m * config.block_n <= 128 * 128), result
    assert result["shared"] <= ws.SHARED_MEMORY_BYTES + 1024, result["shared"]
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(tmp_path / "kernel.cubin")], capture_output=True, text=True,
                           check=True).stdout  # "REG:168 STACK:0 SHARED:... LOCAL:0 ...": spills need stack
    assert " STACK:0 " in usage and " LOCAL:0 " in usage, usage


def test_the_rule_is_hopper_only_and_the_default_config():
    assert RULE.gpus and all("H" in g for g in RULE.gpus) and RULE.min_capability == (9, 0)
    assert DEFAULT_CONFIGS["backward_ws"] == RULE.config
    assert RULE.m[0] > 256, "the split kernel measured faster at M = 129-256"


def test_the_warp_specialized_rules_cover_every_m_from_their_first_on_hopper():
    """128x128 tiles from M = 513, 256x128 tiles from 2049, 128x128 again above 4096: one range after the
    other, the last open."""
    assert len(WS_RULES) >= 2 and WS_RULES[-1].m[1] is None
    for before, after in zip(WS_RULES, WS_RULES[1:]):
        assert after.m[0] == before.m[1] + 1 and after.gpus == before.gpus, (before, after)
    assert [(r.config.block_m, r.config.block_n) for r in WS_RULES] == [(128, 128), (256, 128), (128, 128)]


def test_a_cpu_call_is_refused_by_name():
    dy, wd, p = torch.randn(64, 64, dtype=torch.float16), torch.randn(64, 48, dtype=torch.float16), torch.randn(
        64, 96, dtype=torch.float16)
    with pytest.raises(ValueError, match="backward_ws.*Hopper GPU"):
        gated_backward(dy, wd, p, "silu", kernel="backward_ws")


def test_epilogue_slices_must_stay_inside_one_gate_up_block():
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), APPROX_TANH=False)
    for subtiles in (2, 4, 3):
        with pytest.raises(ValueError, match="8 or 16 columns"):
            ws.make_launcher(C(128, 128, 64, epilogue_subtiles=subtiles), epilogue, torch.float16)
    ws.make_launcher(C(128, 128, 64, epilogue_subtiles=16), epilogue, torch.float16)


def test_each_backward_kernels_default_config_is_its_own_rules():
    """A forced kernel without a config takes a config of its own rules (the split kernel once took the
    warp-specialized kernel's 128x128 tile as its elementwise tile: 10x slower)."""
    for kernel in ("backward_split", "backward_ws"):
        assert DEFAULT_CONFIGS[kernel] in [r.config for r in BACKWARD_RULES if r.kernel == kernel], kernel
