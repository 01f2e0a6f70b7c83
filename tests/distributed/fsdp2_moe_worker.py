"""One rank of the MoE FSDP2 test: ``torchrun --standalone --nproc-per-node 2 fsdp2_moe_worker.py CASE OUT``.

CASE (a tiny MoE checkpoint, plus "probe": token ids [batch, seq]), the sharded model, the
training loop and OUT/rank{r}.pt are `fsdp2_common`'s. For each backend this rank shards the
patched checkpoint (`apply_fused_mlp`: the experts switched to the fused kernels) and records
without judging: how many experts modules were switched; the first experts module's
``gate_up_proj`` layout before, inside (a pre-hook on the experts module) and after a forward;
per AdamW step the global loss; every parameter's full gradient after the first backward and the
trained full state dict (rank 0).

With CASE's "lora" (on the experts' 3-D weights, PEFT's `target_parameters`, and on attention),
"lora:<backend>": PEFT on the patched checkpoint, sharded the same way, trained on the adapters
while PEFT's ways of building W + s*B@A raise (`moe.test_experts_peft.never_materialized`):

- "adapter_layout": the first experts module's gate_up_proj lora_A weight's layout before training;
- "fused": per experts forward, whether `experts_lora.bound_low_rank` handed the fused experts
  PEFT's adapters;
- the global losses, the adapters' full gradients after the first backward, the trained adapters
  and the frozen experts weights;
- "logits" (rank 0): the trained model's on CASE's probe, in eval mode; and the adapters saved by
  ``save_pretrained`` of the gathered state dict (rank 0), in OUT/adapter_<backend>.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import fsdp2_common as common
import torch
import torch.distributed as dist
from fsdp2_common import FULL, layout, plain
from moe.test_experts_peft import never_materialized
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from swiglu_patch import experts_lora
from swiglu_patch.experts import is_switched


def run(case: dict, backend: str, out: Path) -> dict:
    model = common.sharded(case, backend)
    experts = model.model.layers[0].mlp.experts
    rec = {"experts_fused": sum(map(is_switched, model.modules())),
           "before": layout(experts.gate_up_proj)}
    inside = []
    handle = experts.register_forward_pre_hook(lambda m, args: inside.append(layout(m.gate_up_proj)))

    def after_first_forward():
        rec.update(inside=inside[0], after=layout(experts.gate_up_proj))
        handle.remove()

    rec |= common.train(model, case, after_first_forward)
    state = plain(get_model_state_dict(model, options=FULL))  # on every rank: a collective
    if dist.get_rank() == 0:
        rec["state"] = state
    return rec


@contextlib.contextmanager
def bound_adapters(calls: list):
    """Appends to `calls`, per fused experts forward, whether PEFT's adapters were bound to it."""
    original = experts_lora.bound_low_rank

    def spy(module, dtype):
        low_rank = original(module, dtype)
        calls.append(low_rank is not None)
        return low_rank

    experts_lora.bound_low_rank = spy
    try:
        yield
    finally:
        experts_lora.bound_low_rank = original


def run_lora(case: dict, backend: str, out: Path) -> dict:
    model = common.sharded(case, backend, lora=True)
    wrapper = common.base_of(model).model.layers[0].mlp.experts  # PEFT's ParamWrapper (down_proj's, then gate_up_proj's)
    gate_up_a = wrapper.base_layer.lora_A["default"].weight
    rec = {"adapter_layout": layout(gate_up_a), "fused": []}
    with never_materialized(), bound_adapters(rec["fused"]):
        rec |= common.train(model, case)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(case["probe"])).logits
    rec["trained"] = plain(common.trainable(model))
    experts = wrapper.get_base_layer()
    rec["frozen"] = plain({name: getattr(experts, name) for name in experts_lora.ADAPTED})
    state = plain(get_model_state_dict(model, options=FULL))
    if dist.get_rank() == 0:
        rec["logits"] = logits
        model.save_pretrained(out / f"adapter_{backend}", state_dict=state)
    return rec


if __name__ == "__main__":
    common.main(run, run_lora)
