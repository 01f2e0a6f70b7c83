"""What the FSDP2 workers share (`fsdp2_worker.py`, dense; `fsdp2_moe_worker.py`, MoE), and the
unsharded run their LoRA records are held to.

A worker runs as one rank of ``torchrun --standalone --nproc-per-node 2 WORKER CASE OUT``
(`launch.ranks_of`, gloo on CPU). CASE is a JSON file {"path": a checkpoint saved by plain
transformers, "backends": [...], "batches": token ids [steps, batch, seq], "lr": AdamW's learning
rate, and optionally "lora": a `peft.LoraConfig`'s keyword arguments}.

- `sharded(case, backend, lora)`: the checkpoint (fp32), patched with `backend`; with `lora`,
  PEFT's adapters on it (`swiglu_patch.lora.register`, drawn after `torch.manual_seed(0)`); then
  every decoder layer and the model sharded with `fully_shard`, in train mode.
- `train(model, case)`: AdamW on the trainable parameters, each rank on its share of every batch
  (``chunk(world)[rank]``); the global loss per step (the mean of the ranks') and, on rank 0, every
  trainable parameter's full gradient after the first backward.
- `main(run, run_lora)`: per backend, ``run(case, backend, out)`` and, where CASE has "lora",
  ``run_lora(case, backend, out)``; writes OUT/rank{r}.pt: {backend or "lora:<backend>": record,
  or {"exception": traceback, "type": exception class name}}.
- `reference(model, batches, lr)`: the same loop unsharded, in one process, on whole batches;
  `recorded(ranks, key)`: the ranks' records of one run, for the tests.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from peft import LoraConfig, get_peft_model

from swiglu_patch import apply_fused_mlp
from swiglu_patch.lora import register

FULL = StateDictOptions(full_state_dict=True)  # on every rank: set_model_state_dict needs it everywhere


def layout(t) -> tuple:
    """(class, placements, local shape, global shape) of a parameter."""
    return (type(t).__name__, tuple(map(repr, t.placements)) if isinstance(t, DTensor) else None,
            tuple(t.to_local().shape) if isinstance(t, DTensor) else tuple(t.shape), tuple(t.shape))


def plain(state: dict) -> dict:
    """`state` with plain tensors, detached copies (a DTensor would pickle its device mesh into the
    record); a collective where it holds DTensors: call it on every rank."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def base_of(model):
    """The transformers model under a PEFT model (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sharded(case: dict, backend: str, lora: bool = False):
    """The checkpoint patched with `backend` (and with PEFT's adapters where `lora`), sharded per
    decoder layer and then whole (see the module docstring)."""
    model = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    apply_fused_mlp(model, backend=backend)
    if lora:
        torch.manual_seed(0)
        model = get_peft_model(model, register(LoraConfig(**case["lora"])))
    for layer in base_of(model).model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model.train()


def trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def train(model, case: dict, after_first_forward=None) -> dict:
    """AdamW on `model`'s trainable parameters over CASE's batches, each rank on its share:
    {"losses": the global loss per step, "grads" (rank 0): every trainable parameter's full
    gradient after the first backward}. `after_first_forward()` runs before the first backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(trainable(model).values(), lr=case["lr"])
    rec = {"losses": []}
    for step, batch in enumerate(case["batches"]):
        ids = torch.tensor(batch).chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        if step == 0 and after_first_forward is not None:
            after_first_forward()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in trainable(model).items()}  # a collective: every rank
            if rank == 0:
                rec["grads"] = grads
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec["losses"].append(total.item() / world)
    return rec


def _recorded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge; the other runs still go
        return {"exception": traceback.format_exc(), "type": type(e).__name__}


def main(run, run_lora) -> None:
    """One rank's worker: every backend's `run` and, with CASE's "lora", `run_lora` (module docstring)."""
    case_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    case = json.loads(case_file.read_text())
    results = {}
    for backend in case["backends"]:
        results[backend] = _recorded(run, case, backend, out)
        dist.barrier()
        if "lora" in case:
            results[f"lora:{backend}"] = _recorded(run_lora, case, backend, out)
            dist.barrier()
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def reference(model, batches: list, lr: float) -> dict:
    """The unsharded run (`training_common.train`: AdamW, whole batches, the trainable parameters):
    {"losses", "grads": after the first backward, "trained": the parameters after the last step}."""
    from training_stack.training_common import train as train_unsharded

    grads = {}

    class FirstGrads(torch.optim.AdamW):
        def step(self, *a, **k):
            if not grads:
                grads.update({n: p.grad.clone() for n, p in trainable(model).items()})
            return super().step(*a, **k)

    opt = FirstGrads(trainable(model).values(), lr=lr)
    losses = train_unsharded(model, [torch.tensor(b) for b in batches], optimizer=opt)
    return dict(losses=losses, grads=grads, trained={n: p.detach().clone() for n, p in trainable(model).items()})


def recorded(ranks: list[dict], key: str) -> list[dict]:
    """Each rank's record under `key` ("<backend>" or "lora:<backend>"); fails the test with the
    traceback where a rank raised."""
    import pytest

    for r, res in enumerate(ranks):
        if "exception" in res[key]:
            pytest.fail(f"rank {r}, {key} raised {res[key]['type']}:\n{res[key]['exception']}")
    return [res[key] for res in ranks]
