"""Convergence of a patched MoE model against transformers' grouped_mm: `convergence.py`'s run
(Austen's text as bytes, vocab 256, same initial weights, seed and batches, trained side by
side, AdamW) on a Qwen3-MoE model of a few layers with Qwen3-30B-A3B's MoE shape (hidden 2048,
128 experts of I = 768, top-8, 32 query and 4 KV heads of 128). The baseline is the model as
transformers runs it on the GPU (``config._experts_implementation = "grouped_mm"``); the patched
copy runs every experts module on the fused kernels (`apply_fused_mlp`) in `--mode` (store:
the backward reads the saved pre-activation; recompute: it recomputes it).

GPU run (bf16, 200 steps of 8 x 512 tokens; writes convergence.json and convergence.png of both
curves and exits 1 if they disagree beyond atol 1e-2 + rtol 5e-2, the dense run's tolerance):

    python tests/training_stack/convergence_moe.py --text austen.txt --out results/convergence_moe_h100

The text: `convergence.py --write-text` (its docstring says how). CPU check of the script
(tiny sizes, fp32, the PyTorch path):

    python tests/training_stack/convergence_moe.py --out /tmp/c --device cpu --dtype float32 --backend torch \\
        --steps 8 --layers 2 --hidden 64 --experts 8 --moe-intermediate 32 --top-k 2 --heads 4 --kv-heads 2 \\
        --head-dim 16 --seq 32 --batch 4
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from convergence import byte_batches, curves_agree, load_text, plot, train_losses


def build_base(args) -> torch.nn.Module:
    """The random-init Qwen3-MoE causal LM of `args`, every layer an MoE layer, on args.device in args.dtype."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, norm_topk_prob=True, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                            max_position_embeddings=args.seq, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3MoeForCausalLM(config).to(dtype=getattr(torch, args.dtype))
    model.config._experts_implementation = args.baseline
    return model


def side_by_side_moe(base, batches, args) -> tuple[list[float], list[float], dict]:
    """(baseline losses, patched losses, seconds of each run) from two copies of `base` on the same batches."""
    from swiglu_patch import apply_fused_mlp
    from swiglu_patch.experts import set_experts_mode

    patched = copy.deepcopy(base)
    report = apply_fused_mlp(patched, backend=args.backend)
    if set_experts_mode(patched, args.mode) != args.layers:
        raise RuntimeError(f"apply_fused_mlp switched {len(report.experts)} experts modules, not the {args.layers} "
                           "layers': the run would not compare the fused experts")
    seconds = {}
    t0 = time.perf_counter()
    patched_losses = train_losses(patched, batches, args.lr)  # first: a backend that cannot train fails at once
    seconds["patched"] = time.perf_counter() - t0
    del patched
    t0 = time.perf_counter()
    base_losses = train_losses(copy.deepcopy(base), batches, args.lr)
    seconds["baseline"] = time.perf_counter() - t0
    return base_losses, patched_losses, seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for convergence.json and convergence.png")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--backend", default="auto", help="apply_fused_mlp backend (auto: Triton on CUDA)")
    p.add_argument("--mode", choices=["store", "recompute"], default="store", help="set_experts_mode of the patched run")
    p.add_argument("--baseline", default="grouped_mm", help="transformers' experts implementation of the baseline")
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=5e-2)
    p.add_argument("--text", help="a UTF-8 text file to train on (default: convergence.py's search)")
    p.add_argument("--janeaustenr", help="the R package's folder")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from swiglu_patch.provenance import environment

    text, source = load_text(args.text, args.janeaustenr)
    base = build_base(args)
    batches = byte_batches(text, args.steps, args.batch, args.seq)
    baseline, patched, seconds = side_by_side_moe(base, batches, args)
    ok, worst, step = curves_agree(baseline, patched, args.atol, args.rtol)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(
        what=f"training loss, transformers' {args.baseline} vs swiglu-patch's fused experts ({args.mode} mode), "
             "same init, seed and batches",
        config=vars(args) | {"text_source": source, "text_chars": len(text),
                             "params": sum(p.numel() for p in base.parameters())},
        environment=environment(args.device, args.commit), seconds=seconds,
        losses_baseline=baseline, losses_patched=patched,
        max_abs_diff=max(abs(a - b) for a, b in zip(baseline, patched)),
        worst_excess_over_bound=worst, worst_step=step + 1, passed=ok,
    )
    (out / "convergence.json").write_text(json.dumps(record, indent=1, default=str))
    plot(baseline, patched, out / "convergence.png",
         f"Qwen3-MoE {args.layers}x{args.hidden}, {args.experts} experts I={args.moe_intermediate} top-{args.top_k}, "
         f"{args.dtype}, {args.steps} steps, {args.mode} mode; max |diff| {record['max_abs_diff']:.2e}",
         baseline_label=f"transformers {args.baseline}")
    print(f"{args.baseline} {baseline[0]:.4f} -> {baseline[-1]:.4f}, patched {patched[0]:.4f} -> {patched[-1]:.4f}, "
          f"max |diff| {record['max_abs_diff']:.3e}; {'PASS' if ok else 'FAIL'} (atol {args.atol}, rtol {args.rtol}); "
          f"wrote {out}/convergence.json and .png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
