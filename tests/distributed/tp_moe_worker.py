"""One rank of `test_tp_moe.py`: a tiny Qwen3-MoE checkpoint loaded with ``tp_plan="auto"``, its
logits before and after `apply_fused_mlp(backend=...)`, and after `unpatch`, saved as rank{r}.pt.

    python -m torch.distributed.run --nproc-per-node 2 tp_moe_worker.py CHECKPOINT BACKEND OUT
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from swiglu_patch import apply_fused_mlp, unpatch

IDS = [[5, 17, 99, 3, 42, 120, 7, 64, 31], [88, 12, 9, 127, 50, 3, 71, 26, 100]]

path, backend, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
result = {}
try:
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        result["plain"] = model(ids).logits
        report = apply_fused_mlp(model, backend=backend)
        result["experts"] = list(report.experts)
        result["weight_type"] = type(model.model.layers[0].mlp.experts.gate_up_proj).__name__
        result["patched"] = model(ids).logits
        unpatch(model)
        result["unpatched"] = model(ids).logits
except Exception:  # noqa: BLE001 - recorded for the test to show
    result["exception"] = traceback.format_exc()
torch.save(result, os.path.join(out, f"rank{rank}.pt"))
dist.destroy_process_group()
