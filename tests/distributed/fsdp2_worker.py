"""One rank of the FSDP2 tests: ``torchrun --standalone --nproc-per-node 2 fsdp2_worker.py CASE OUT``.

CASE and the sharded model, the training loop and OUT/rank{r}.pt are `fsdp2_common`'s. For each
backend this rank shards the patched checkpoint and records without judging:

- the packed weight's placements and local shape before, inside (a pre-hook on the fused
  module) and after a forward;
- per training step (AdamW, each rank its half of the batch): the global loss and, after the
  first backward, every parameter's full gradient;
- after training: the full state dict (`get_model_state_dict`, full_state_dict=True, rank 0);
  the sharded state dict's keys and placements; a DCP save of it, loaded into a freshly
  sharded patched model (`dcp.load` + `set_model_state_dict`), and the full state dict of
  that; the trained full state dict loaded into another fresh one with
  ``set_model_state_dict(full_state_dict=True)``, and its full state dict.

With CASE's "lora", "lora:<backend>": PEFT LoRA on the patched checkpoint, sharded the same way
and trained with AdamW on the adapters: the global losses, the adapters' full gradients after
the first backward, and the adapters and the frozen packed weight after training.
"""

from __future__ import annotations

from pathlib import Path

import fsdp2_common as common
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp2_common import FULL, layout, plain
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


def run(case: dict, backend: str, out: Path) -> dict:
    model = common.sharded(case, backend)
    mlp = model.model.layers[0].mlp
    packed = {"packed_before": layout(mlp.gate_up_interleaved)}
    inside = []
    handle = mlp.register_forward_pre_hook(lambda m, args: inside.append(layout(m.gate_up_interleaved)))

    def after_first_forward():
        packed.update(packed_inside=inside[0], packed_after=layout(mlp.gate_up_interleaved))
        handle.remove()

    rec = common.train(model, case, after_first_forward) | packed
    rec["packed_trained"] = layout(mlp.gate_up_interleaved)

    full = get_model_state_dict(model, options=FULL)
    sharded = get_model_state_dict(model)
    rec["sharded_keys"] = {k: layout(v) for k, v in sharded.items()}
    ckpt = out / f"dcp_{backend}"
    dcp.save(sharded, checkpoint_id=str(ckpt))

    fresh = common.sharded(case, backend)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=str(ckpt))
    set_model_state_dict(fresh, state)
    from_dcp = get_model_state_dict(fresh, options=FULL)

    other = common.sharded(case, backend)
    set_model_state_dict(other, dict(full), options=FULL)  # a copy: it adds keys to the dict
    from_full = get_model_state_dict(other, options=FULL)
    states = [plain(s) for s in (full, from_dcp, from_full)]  # on every rank: full_tensor is a collective
    if dist.get_rank() == 0:
        rec["full"], rec["from_dcp"], rec["from_full"] = states
    return rec


def run_lora(case: dict, backend: str, out: Path) -> dict:
    model = common.sharded(case, backend, lora=True)
    rec = common.train(model, case)
    rec["trained"] = plain(common.trainable(model))
    rec["packed"] = plain({"packed": common.base_of(model).model.layers[0].mlp.gate_up_interleaved})["packed"]
    return rec


if __name__ == "__main__":
    common.main(run, run_lora)
