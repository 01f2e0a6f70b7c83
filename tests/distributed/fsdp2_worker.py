"""One rank of the FSDP2 tests: ``torchrun --standalone --nproc-per-node 2 fsdp2_worker.py CASE OUT``.

CASE is a JSON file {"path": a checkpoint saved by plain transformers, "backends": [...],
"batches": token ids [steps, batch, seq], "lr": AdamW's learning rate}. For each backend this
rank loads the checkpoint (fp32), patches it, shards every decoder layer and then the model with
`torch.distributed.fsdp.fully_shard` (gloo, CPU), and records without judging:

- the packed weight's placements and local shape before, inside (a pre-hook on the fused
  module) and after a forward;
- per training step (AdamW, each rank its half of the batch): the global loss (the mean of the
  ranks' losses) and, after the first backward, every parameter's full gradient;
- after training: the full state dict (`get_model_state_dict`, full_state_dict=True, rank 0);
  the sharded state dict's keys and placements; a DCP save of it, loaded into a freshly
  sharded patched model (`dcp.load` + `set_model_state_dict`), and the full state dict of
  that; the trained full state dict loaded into another fresh one with
  ``set_model_state_dict(full_state_dict=True)``, and its full state dict.

With CASE's "lora" (a `peft.LoraConfig`'s keyword arguments), each backend also runs
"lora:<backend>": the checkpoint patched, PEFT LoRA applied through `swiglu_patch.lora.register`
(adapters drawn after `torch.manual_seed(0)`), then sharded the same way and trained with AdamW
on the adapters: the global losses, the adapters' full gradients after the first backward, and
the adapters and the frozen packed weight after training.

Writes OUT/rank{r}.pt: {backend or "lora:<backend>": record or {"exception": traceback, "type": name}}.
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
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from peft import LoraConfig, get_peft_model  # noqa: E402

from swiglu_patch import apply_fused_mlp  # noqa: E402
from swiglu_patch.lora import register  # noqa: E402

FULL = StateDictOptions(full_state_dict=True)  # on every rank: set_model_state_dict needs it everywhere


def sharded_patched(path: str, backend: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_fused_mlp(model, backend=backend)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model.train()


def layout(t) -> tuple:
    return (type(t).__name__, tuple(map(repr, t.placements)) if isinstance(t, DTensor) else None,
            tuple(t.to_local().shape) if isinstance(t, DTensor) else tuple(t.shape), tuple(t.shape))


def plain(state: dict) -> dict:
    """The state dict with plain tensors (a DTensor would pickle its device mesh into the record)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def run(case: dict, backend: str, out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = {}
    model = sharded_patched(case["path"], backend)
    mlp = model.model.layers[0].mlp
    rec["packed_before"] = layout(mlp.gate_up_interleaved)
    inside = []
    handle = mlp.register_forward_pre_hook(lambda m, args: inside.append(layout(m.gate_up_interleaved)))
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"])
    rec["losses"] = []
    for step, batch in enumerate(case["batches"]):
        ids = torch.tensor(batch).chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        if step == 0:
            rec["packed_inside"], rec["packed_after"] = inside[0], layout(mlp.gate_up_interleaved)
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
    rec["packed_trained"] = layout(mlp.gate_up_interleaved)

    full = get_model_state_dict(model, options=FULL)
    sharded = get_model_state_dict(model)
    rec["sharded_keys"] = {k: layout(v) for k, v in sharded.items()}
    ckpt = out / f"dcp_{backend}"
    dcp.save(sharded, checkpoint_id=str(ckpt))

    fresh = sharded_patched(case["path"], backend)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=str(ckpt))
    set_model_state_dict(fresh, state)
    from_dcp = get_model_state_dict(fresh, options=FULL)

    other = sharded_patched(case["path"], backend)
    set_model_state_dict(other, dict(full), options=StateDictOptions(full_state_dict=True))  # it adds keys to the dict
    from_full = get_model_state_dict(other, options=FULL)
    states = [plain(s) for s in (full, from_dcp, from_full)]  # on every rank: full_tensor is a collective
    if rank == 0:
        rec["full"], rec["from_dcp"], rec["from_full"] = states
    return rec


def run_lora(case: dict, backend: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    apply_fused_mlp(model, backend=backend)
    torch.manual_seed(0)
    model = get_peft_model(model, register(LoraConfig(**case["lora"])))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=case["lr"])
    rec = {"losses": []}
    for step, batch in enumerate(case["batches"]):
        ids = torch.tensor(batch).chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            rec["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec["losses"].append(total.item() / world)
    rec["trained"] = plain({n: p for n, p in model.named_parameters() if p.requires_grad})
    mlp = model.base_model.model.model.layers[0].mlp
    rec["packed"] = plain({"packed": mlp.gate_up_interleaved})["packed"]
    return rec


def main() -> None:
    case_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    case = json.loads(case_file.read_text())
    results = {}
    for backend in case["backends"]:
        try:
            results[backend] = run(case, backend, out)
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge; the other backends still run
            results[backend] = {"exception": traceback.format_exc(), "type": type(e).__name__}
        dist.barrier()
        if "lora" in case:
            try:
                results[f"lora:{backend}"] = run_lora(case, backend)
            except Exception as e:  # noqa: BLE001 - recorded, as above
                results[f"lora:{backend}"] = {"exception": traceback.format_exc(), "type": type(e).__name__}
            dist.barrier()
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
