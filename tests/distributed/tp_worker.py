"""One rank of the tensor-parallel tests: ``torchrun --standalone --nproc-per-node N tp_worker.py CASES OUT``.

CASES is a JSON file: a list of {"name", "path", "expect": "patch" | "refuse", "grad": bool, "ids"},
each path a checkpoint saved by plain transformers, ids the prompt (token ids [batch, seq]). For
every case this rank loads the checkpoint with ``tp_plan="auto"`` (gloo on CPU) and records what
the tests check, without judging it:

- "patch": logits and a save_pretrained directory of the plain TP model; its local shards; live
  bytes while patching; logits and greedy tokens of the patched model (backend "auto", then
  "triton" under TRITON_INTERPRET=1); its packed local weights; its state_dict against the plain
  one; a save_pretrained directory; a load_state_dict round trip; logits and parameters after
  unpatch; weight bytes held and one MLP's activation peak, eager and fused; KV-cache bytes per
  token; with "grad", the input and weight gradients of a patched forward/backward (backend "torch").
- "refuse": the PatchError of apply_fused_mlp, the strict=False report, and whether the
  model's parameters and logits stayed as they were.

Runs under torch.no_grad() except for the gradients. Writes OUT/rank{r}.pt (a dict per case) for the
test to compare with single-process references.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from live_bytes import LiveBytes
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.patch import activation_of
from swiglu_patch.probe import probe
from swiglu_patch.registry import KNOWN_MLP_CLASSES
from swiglu_patch import FusedGatedMLP, PatchError, apply_fused_mlp, unpatch

MLP_TOKENS = 64


def load_tp(path: str):
    """The checkpoint sharded over all ranks by the model's own tp_plan ("auto")."""
    try:
        from transformers import DistributedConfig  # transformers 5.x; tp_plan= is deprecated there
    except ImportError:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")).eval()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(model) -> dict:
    """{key: (local tensor clone, placements or None, global shape)} of the model's state dict."""
    return {k: (local(v).detach().clone(), tuple(map(str, v.placements)) if isinstance(v, DTensor) else None,
                tuple(v.shape)) for k, v in model.state_dict().items()}


def diff_state(before: dict, after: dict) -> list[str]:
    """Keys whose local tensor (bit for bit), placements or global shape differ, or that one side lacks."""
    bad = sorted(set(before) ^ set(after))
    for k in set(before) & set(after):
        (t0, p0, s0), (t1, p1, s1) = before[k], after[k]
        if p0 != p1 or s0 != s1 or t0.dtype != t1.dtype or t0.shape != t1.shape or not torch.equal(t0, t1):
            bad.append(k)
    return sorted(bad)


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of the parameters' local tensors, bytes of the storages behind them) on this rank.

    Tied parameters count once. The two differ where a local shard is a view of a larger
    storage (transformers' CPU loading keeps a column shard's whole tensor behind it).
    """
    tensors, storages, total = set(), {}, 0
    for p in model.parameters():
        t = local(p)
        if t.device.type == "meta" or id(p) in tensors:
            continue
        tensors.add(id(p))
        total += t.numel() * t.element_size()
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return total, sum(storages.values())


def mlp_peak(mlp, hidden: int) -> int:
    """Bytes above the input and weights at the peak of one MLP forward on [MLP_TOKENS, K]."""
    x = torch.randn(MLP_TOKENS, hidden, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), LiveBytes() as lb:
        mlp(x)
    return lb.peak


def kv_bytes_per_token(model, ids) -> float:
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / ids.shape[1] / ids.shape[0]


def run_patch(case: dict, out_dir: Path) -> dict:
    r: dict = {}
    model = load_tp(case["path"])
    config = model.config
    ids = torch.tensor(case["ids"])
    with torch.no_grad():
        r["logits_plain"] = model(ids).logits
    r["kv_bytes_per_token"] = kv_bytes_per_token(model, ids)
    before = local_state(model)
    model.save_pretrained(out_dir / f"saved_plain_{case['name']}")
    r["saved_plain"] = str(out_dir / f"saved_plain_{case['name']}")
    r["weight_bytes_plain"] = weight_bytes(model)
    r["mlp_peak_eager"] = mlp_peak(model.model.layers[0].mlp, config.hidden_size)

    mlp0 = model.model.layers[0].mlp
    family = KNOWN_MLP_CLASSES[type(mlp0).__name__]
    with LiveBytes() as lp:  # the probe's small copies: a fixed cost, whatever the model's size
        probe(mlp0, family, GatedEpilogue(activation_of(mlp0, family, True)))
    r["probe_peak"] = lp.peak
    with LiveBytes(watch=[local(p) for p in model.parameters()]) as lb:
        r["report"] = str(apply_fused_mlp(model))
    r["patch_peak"], r["patch_net"] = lb.peak, lb.current
    mlps = [m for m in model.modules() if isinstance(m, FusedGatedMLP)]
    r["packed"] = [m.gate_up_interleaved.detach().clone() for m in mlps]
    r["packed_bias"] = [m.gate_up_interleaved_bias.detach().clone() if m.gate_up_interleaved_bias is not None
                        else None for m in mlps]
    r["weight_bytes_patched"] = weight_bytes(model)
    with torch.no_grad():
        r["logits_auto"] = model(ids).logits
        r["greedy"] = model.generate(ids, max_new_tokens=6, do_sample=False)
    r["state_dict_diff"] = diff_state(before, local_state(model))

    saved = out_dir / f"saved_{case['name']}"
    model.save_pretrained(saved)
    r["saved"] = str(saved)

    sd = {k: v.detach().clone() if not isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    with torch.no_grad():
        for m in mlps:
            m.gate_up_interleaved.zero_()
    result = model.load_state_dict(sd, strict=True)
    r["load_missing_unexpected"] = (list(result.missing_keys), list(result.unexpected_keys))
    with torch.no_grad():
        r["logits_reloaded"] = model(ids).logits

    r["unpatched"] = unpatch(model)
    r["unpatch_diff"] = diff_state(before, local_state(model))
    r["unpatch_types"] = sorted({type(p).__name__ for p in model.parameters()})
    with torch.no_grad():
        r["logits_unpatched"] = model(ids).logits

    apply_fused_mlp(model, backend="triton")
    with torch.no_grad():
        r["logits_triton"] = model(ids).logits
    r["mlp_peak_fused"] = mlp_peak(model.model.layers[0].mlp, config.hidden_size)
    unpatch(model)

    if case.get("grad"):
        apply_fused_mlp(model, backend="torch")
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeds).logits.square().mean().backward()
        r["grad_embeds"] = embeds.grad
        r["grad_packed"] = [m.gate_up_interleaved.grad.clone() for m in model.modules()
                            if isinstance(m, FusedGatedMLP)]
        unpatch(model)
    return r


def run_refuse(case: dict) -> dict:
    r: dict = {}
    model = load_tp(case["path"])
    ids = torch.tensor(case["ids"])
    before = local_state(model)
    with torch.no_grad():
        logits = model(ids).logits
    try:
        apply_fused_mlp(model)
        r["error"] = None
    except PatchError as e:
        r["error"] = str(e)
    report = apply_fused_mlp(model, strict=False)
    r["skipped"] = [(n.name, n.reason) for n in report.not_patched]
    r["patched"] = report.patched
    r["state_diff"] = diff_state(before, local_state(model))
    with torch.no_grad():
        r["logits_equal"] = torch.equal(model(ids).logits, logits)
    return r


def main() -> None:
    cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {"tp": None}
    for case in cases:
        try:
            results[case["name"]] = run_patch(case, out_dir) if case["expect"] == "patch" else run_refuse(case)
        except Exception:  # noqa: BLE001 - recorded for the test to show; the other cases still run on every rank
            results[case["name"]] = {"exception": traceback.format_exc()}
    results["tp"] = dist.get_world_size()
    torch.save(results, out_dir / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
