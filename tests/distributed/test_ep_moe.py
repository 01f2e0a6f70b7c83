"""Tiny MoE models (Qwen3-MoE; gpt-oss, whose experts have biases; Mixtral) loaded under
transformers' expert-parallel plan (2 gloo ranks on CPU: each rank holds whole experts, E/2 of
them, as `Shard(0)` DTensors) run their experts on the fused experts kernels.

The EP plan hands the experts forward the rank's local weights and local expert ids, with the
routes to the other rank's experts either masked to the sentinel id E/2 at weight 0 (the
all-reduce way: transformers 5.21+'s "auto" at inference, and the only plan before 5.21) or
not sent at all (5.21+'s "all_to_all": the rank gets the tokens routed to its experts, top-1,
weight 1). The fused experts add nothing for a sentinel, so each rank's output is its partial
sum, as transformers' own experts give it. Checked for each family and plan, on the PyTorch path
and on the Triton kernels (interpreter): the fused forward ran on every rank with the local
experts (and saw the sentinel where the plan masks), logits equal the single-process unpatched
model's within twice the larger of two fp32 errors (the unpatched EP model's, and the fused
experts' on one process) plus 1e-6 of the logits' scale, greedy tokens equal, and `unpatch`
gives the EP model back bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import interpreter_subprocess_env
from training_stack.training_common import cpu_train_backends

from swiglu_patch import apply_fused_mlp, unpatch
from zoo.tiny_zoo import build

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("ep_moe_worker.py")
IDS = [[5, 17, 99, 3, 42, 120, 7, 64, 31], [88, 12, 9, 127, 50, 3, 71, 26, 100]]  # ep_moe_worker.IDS
NEW_TOKENS = 3  # ep_moe_worker.NEW_TOKENS
FAMILIES = ("qwen3_moe", "gpt_oss", "mixtral")


def _single(family: str, backend: str, path: Path) -> dict:
    """The single-process model's logits and greedy tokens, unpatched, and its patched logits."""
    model = build(family).model
    model.save_pretrained(path)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        ref = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False)[:, ids.shape[1]:]
        apply_fused_mlp(model, backend=backend)
        fused = model(ids).logits
        unpatch(model)
    return {"ref": ref, "fused": fused, "tokens": tokens, "experts": model.config.num_local_experts
            if hasattr(model.config, "num_local_experts") else model.config.num_experts}


@pytest.mark.parametrize("backend", cpu_train_backends())  # its single-process reference runs in this process
def test_ep_moe_experts_fused(backend, tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no torch.distributed with the gloo backend; the EP tests need it")
    single = {f: _single(f, backend, tmp_path / f) for f in FAMILIES}
    env = interpreter_subprocess_env(kernels=backend == "triton", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(tmp_path), backend, str(tmp_path), *FAMILIES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    ranks = [tmp_path / f"rank{r}.pt" for r in range(2)]
    assert proc.returncode == 0 and all(f.exists() for f in ranks), (proc.stdout + proc.stderr)[-4000:]
    for f in ranks:
        results = torch.load(f, weights_only=False)
        assert results["plans"]
        for family in FAMILIES:
            s = single[family]
            scale = s["ref"].abs().max().item()
            fused_err = (s["fused"] - s["ref"]).abs().max().item()
            for plan in results["plans"]:
                res = results[family, plan]
                case = f"{family}, {plan}, {f.name}"
                assert "exception" not in res, f"{case}: {res.get('exception')}"
                assert res["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], case
                # sharded by the EP plan: whole experts per rank, not gathered by the patch
                assert res["weight_type"] == "DTensor" and res["placements"] == ["Shard(dim=0)"], case
                local = s["experts"] // 2
                assert res["global_experts"] == s["experts"] and res["local_experts"] == local, case
                # the fused forward ran for both layers, on the rank's local (plain) weights
                assert len(res["calls"]) == 2, case
                for call in res["calls"]:
                    assert call["local_experts"] == local and call["weight_type"] == "Tensor", case
                    if plan == "all_to_all":  # only the pairs routed here, with local ids
                        assert call["max_id"] < local, case
                    else:  # every token, the other rank's routes masked to the sentinel id E/2
                        assert call["tokens"] == len(IDS) * len(IDS[0]) and call["max_id"] == local, case
                plain_err = (res["plain"] - s["ref"]).abs().max().item()
                assert plain_err <= 1e-5 * scale, case
                err = (res["patched"] - s["ref"]).abs().max().item()
                assert err <= 2 * max(plain_err, fused_err) + 1e-6 * scale, (case, err, plain_err, fused_err)
                assert torch.equal(res["tokens"], s["tokens"]), case
                assert torch.equal(res["unpatched"], res["plain"]), case
                assert res["implementation_after"] != "swiglu_patch" and res["weight_type_after"] == "DTensor", case
