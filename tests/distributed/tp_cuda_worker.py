"""Tensor parallelism on CUDA (NCCL): a patched TP model against the single-GPU model, bf16.

Run by `test_tp_cuda.py` (or by hand: `torchrun --standalone --nproc-per-node 2
tests/distributed/tp_cuda_worker.py`, with OUT=folder for tp_cuda.json). Each rank loads a
4-layer Llama (hidden 1024, I 2816) with tp_plan="auto" and, beside it, the whole model on its
GPU; it records the relative error of the TP model's logits against the single-GPU model's,
unpatched and patched, greedy tokens of both, and whether unpatch restores the TP logits.
"""
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
out = os.environ.get("OUT", "/tmp")
path = os.environ.get("TP_CUDA_MODEL", "/tmp/tp_llama")
if rank == 0 and not os.path.exists(path + "/config.json"):
    cfg = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=8, vocab_size=4096,
                               max_position_embeddings=512, initializer_range=0.05)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    open(path + "/.done", "w").close()
while not os.path.exists(path + "/.done"):
    time.sleep(0.2)
from swiglu_patch import apply_fused_mlp, unpatch  # noqa: E402 - after rank 0 wrote the checkpoint
try:
    from transformers import DistributedConfig
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                              distributed_config=DistributedConfig(tp_plan="auto")).eval()
except ImportError:
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, tp_plan="auto").eval()
single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(f"cuda:{rank}").eval()
torch.manual_seed(1)
ids = torch.randint(3, 4096, (2, 64), device=f"cuda:{rank}")
res = {}
with torch.inference_mode():
    ref = single(ids).logits.double()
    plain = tp(ids).logits.double()
    report = apply_fused_mlp(tp)
    fused = tp(ids).logits.double()
    g_single = single.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    g_fused = tp.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    single_patched = apply_fused_mlp(single)
    fused_single = single(ids).logits.double()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


res["report"] = str(report).splitlines()[0]
res["rel_tp_plain_vs_single"] = rel(plain, ref)
res["rel_tp_fused_vs_single"] = rel(fused, ref)
res["rel_single_fused_vs_single"] = rel(fused_single, ref)
res["greedy_tokens_equal"] = bool(torch.equal(g_single, g_fused))
res["greedy_agree_frac"] = (g_single == g_fused).float().mean().item()
res["unpatched"] = unpatch(tp)
with torch.inference_mode():
    res["rel_after_unpatch_vs_plain"] = rel(tp(ids).logits.double(), plain)
if rank == 0:
    print(json.dumps(res, indent=1))
    json.dump(res | {"gpu": torch.cuda.get_device_name(0), "world": world, "torch": torch.__version__},
              open(os.path.join(out, "tp_cuda.json"), "w"), indent=1)
dist.destroy_process_group() if dist.is_initialized() else None
