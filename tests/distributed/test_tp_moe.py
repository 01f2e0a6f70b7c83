"""A Qwen3-MoE model sharded by transformers' ``tp_plan="auto"`` (2 gloo ranks on CPU) runs its experts
on the fused experts kernels: transformers' MoE TP style hands each rank its local shard of every
expert ([G_r; U_r] and the matching down columns) and all-reduces the block's output, so the fused
experts compute each rank's partial sum as they compute a whole block. Logits equal the single-process
model's, through the PyTorch path and the Triton kernels (interpreter); unpatch restores the TP model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import interpreter_subprocess_env
from transformers import AutoModelForCausalLM

from zoo.tiny_zoo import build

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("tp_moe_worker.py")
IDS = [[5, 17, 99, 3, 42, 120, 7, 64, 31], [88, 12, 9, 127, 50, 3, 71, 26, 100]]  # tp_moe_worker.IDS


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp_qwen3_moe_experts_fused(backend, tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no torch.distributed with the gloo backend; the TP tests need it")
    build("qwen3_moe").model.save_pretrained(tmp_path / "ckpt")
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        ref = single(torch.tensor(IDS)).logits
    env = interpreter_subprocess_env(kernels=backend == "triton")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(tmp_path / "ckpt"), backend, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    ranks = [tmp_path / f"rank{r}.pt" for r in range(2)]
    assert proc.returncode == 0 and all(f.exists() for f in ranks), (proc.stdout + proc.stderr)[-4000:]
    scale = ref.abs().max().item()
    for f in ranks:
        res = torch.load(f, weights_only=False)
        assert "exception" not in res, res.get("exception")
        assert res["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert res["weight_type"] == "DTensor"  # sharded by the TP plan, not gathered by the patch
        assert (res["plain"] - ref).abs().max().item() <= 1e-5 * scale
        assert (res["patched"] - ref).abs().max().item() <= 1e-4 * scale
        assert torch.equal(res["unpatched"], res["plain"])
