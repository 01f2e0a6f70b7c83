"""One rank of `test_ep_moe.py`: tiny MoE checkpoints loaded under transformers' expert-parallel
plan, their logits before and after `apply_fused_mlp(backend=...)` and after `unpatch`, what the
fused experts were handed, and greedy tokens; saved as rank{r}.pt.

    python -m torch.distributed.run --nproc-per-node 2 ep_moe_worker.py ROOT BACKEND OUT FAMILY...

ROOT/FAMILY is a checkpoint for each FAMILY. `ep_config` reads which EP API the installed
transformers has; every case of `plans()` loads each checkpoint again.
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig
from transformers.integrations.moe import ExpertsInterface

from swiglu_patch import apply_fused_mlp, unpatch
from swiglu_patch.experts import IMPLEMENTATION, fused_experts_forward

IDS = [[5, 17, 99, 3, 42, 120, 7, 64, 31], [88, 12, 9, 127, 50, 3, 71, 26, 100]]  # test_ep_moe.IDS
NEW_TOKENS = 3  # test_ep_moe.NEW_TOKENS


def plans() -> tuple[str, ...]:
    """The EP implementations to run: transformers 5.21+ names them (`ep_implementation`, "auto"
    is all-reduce at inference); earlier ones have one plan (router masking, then all-reduce)."""
    fields = DistributedConfig.__dataclass_fields__
    return ("auto", "all_to_all") if "ep_implementation" in fields else ("plan",)


def ep_config(world: int, plan: str) -> DistributedConfig:
    """Experts by expert over `world` ranks. transformers 5.21+: `ep_size` (the dense modules keep
    the model's TP plan); earlier: `enable_expert_parallel` (the EP plan replaces the TP plan)."""
    if "ep_size" in DistributedConfig.__dataclass_fields__:
        return DistributedConfig(tp_size=world, ep_size=world, ep_implementation=plan)
    return DistributedConfig(tp_size=world, enable_expert_parallel=True)


def run_case(path: str, backend: str, plan: str, world: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=ep_config(world, plan))
    experts = model.model.layers[0].mlp.experts
    ids = torch.tensor(IDS)
    seen = []

    def counting(module, hidden_states, top_k_index, top_k_weights):
        seen.append({"tokens": hidden_states.shape[0], "max_id": int(top_k_index.max()),
                     "local_experts": module.gate_up_proj.shape[0],
                     "weight_type": type(module.gate_up_proj).__name__})
        return fused_experts_forward(module, hidden_states, top_k_index, top_k_weights)

    result = {"weight_type": type(experts.gate_up_proj).__name__,
              "placements": [repr(p) for p in getattr(experts.gate_up_proj, "placements", ())],
              "global_experts": experts.gate_up_proj.shape[0], "local_experts": experts.num_experts}
    with torch.no_grad():
        result["plain"] = model(ids).logits
        report = apply_fused_mlp(model, backend=backend)
        result["experts"] = list(report.experts)
        ExpertsInterface.register(IMPLEMENTATION, counting)  # the fused forward, counted
        try:
            result["patched"] = model(ids).logits
            result["calls"] = list(seen)
            result["tokens"] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                              do_sample=False)[:, ids.shape[1]:]
        finally:
            ExpertsInterface.register(IMPLEMENTATION, fused_experts_forward)
        unpatch(model)
        result["unpatched"] = model(ids).logits
        result["implementation_after"] = experts.config._experts_implementation
        result["weight_type_after"] = type(experts.gate_up_proj).__name__
    return result


def main() -> None:
    root, backend, out, *families = sys.argv[1:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {"plans": plans()}
    for family in families:
        for plan in plans():
            try:
                results[family, plan] = run_case(os.path.join(root, family), backend, plan, world)
            except Exception:  # noqa: BLE001 - recorded for the test to show
                results[family, plan] = {"exception": traceback.format_exc()}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
