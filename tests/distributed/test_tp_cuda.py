"""Tensor parallelism on CUDA with NCCL (2 GPUs): the patched TP model agrees with the single-GPU
model as closely as the unpatched TP model does, greedy tokens match, unpatch restores it.
Skipped, with the reason, on machines with fewer than 2 GPUs (the CPU tests use gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_cuda_worker.py")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL); the gloo tests cover CPU")
def test_patched_tp_model_matches_single_gpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TP_CUDA_MODEL=str(tmp_path / "model"), NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "tp_cuda.json").read_text())
    assert res["report"].startswith("apply_fused_mlp: patched 4 MLP(s)")
    assert res["rel_tp_fused_vs_single"] <= 1.5 * res["rel_tp_plain_vs_single"] + 1e-3
    assert res["greedy_tokens_equal"] and res["unpatched"] == 4 and res["rel_after_unpatch_vs_plain"] == 0.0
