"""One rank of the MoE FSDP2 test: ``torchrun --standalone --nproc-per-node 2 fsdp2_moe_worker.py CASE OUT``.

CASE is a JSON file {"path": a tiny MoE checkpoint saved by plain transformers, "backends": [...],
"batches": token ids [steps, batch, seq], "lr": AdamW's learning rate}. For each backend this rank
loads the checkpoint (fp32), patches it (`apply_fused_mlp`: the experts switched to the fused
kernels), shards every decoder layer and then the model with `fully_shard` (gloo, CPU), and
records without judging: the first experts module's ``gate_up_proj`` layout before, inside (a
pre-hook on the experts module) and after a forward; per AdamW step on this rank's half of the
batch, the global loss (the mean of the ranks'); every parameter's full gradient after the first
backward (rank 0); and the trained full state dict (rank 0).

Writes OUT/rank{r}.pt: {backend: record or {"exception": traceback}}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before swiglu_patch imports triton

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from swiglu_patch import apply_fused_mlp  # noqa: E402


def layout(t) -> tuple:
    """(class, placements, local shape, global shape) of a parameter."""
    return (type(t).__name__, tuple(map(repr, t.placements)) if isinstance(t, DTensor) else None,
            tuple(t.to_local().shape) if isinstance(t, DTensor) else tuple(t.shape), tuple(t.shape))


def run(case: dict, backend: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    report = apply_fused_mlp(model, backend=backend)
    rec = {"experts_fused": len(report.experts)}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    experts = model.model.layers[0].mlp.experts
    rec["before"] = layout(experts.gate_up_proj)
    inside = []
    handle = experts.register_forward_pre_hook(lambda m, args: inside.append(layout(m.gate_up_proj)))
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"])
    rec["losses"] = []
    for step, batch in enumerate(case["batches"]):
        ids = torch.tensor(batch).chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        if step == 0:
            rec["inside"], rec["after"] = inside[0], layout(experts.gate_up_proj)
            handle.remove()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                rec["grads"] = grads
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec["losses"].append(total.item() / world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in full.items()}
    if rank == 0:
        rec["state"] = full
    return rec


def main() -> None:
    case, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results = {}
    for backend in case["backends"]:
        try:
            results[backend] = run(case, backend)
        except Exception:  # noqa: BLE001 - recorded for the test to report
            results[backend] = {"exception": traceback.format_exc()}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
