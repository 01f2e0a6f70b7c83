"""A real-size random-init model, eager against patched: logits, top-1 agreement, greedy tokens.

Builds a model with Llama-3-8B's real dimensions (hidden 4096, intermediate 14336, 32 heads,
8 KV heads, vocab 128256) and a few layers, in bf16 on CUDA, and compares the patched model's
logits with eager bf16 and with an fp32 eager reference of the same weights: the fused model
must be as close to the fp32 reference as eager bf16 is (it rounds once instead of four times),
for the whole model and for each MLP on the same input. Random-init logits are nearly flat,
so top-1 agreement between any two precisions is low; the relative errors are the measure.

    python -m benchmarks.validate_model --layers 4 --out $OUT/validate
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from swiglu_patch import apply_fused_mlp, unpatch


def llama3_8b_config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        hidden_act="silu", tie_word_embeddings=False,
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/validate"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama3_8b_config(args.layers)).to("cuda", torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    mlp_in: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda mod, a, idx=idx: mlp_in.__setitem__(idx, a[0].detach()))
        for idx, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        ref32 = model(ids).logits.float()
        model.to(torch.bfloat16)
        eager = model(ids).logits.float()
        for h in hooks:
            h.remove()
        # per layer: the MLP on the same bf16 input, eager bf16 and fp32 (weights upcast)
        mlp_eager, mlp_ref = {}, {}
        for idx, layer in enumerate(model.model.layers):
            mlp, x = layer.mlp, mlp_in[idx]
            mlp_eager[idx] = mlp(x).float()
            g, u, d = (lin.weight.float() for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            xf = x.float()
            mlp_ref[idx] = (torch.nn.functional.silu(xf @ g.T) * (xf @ u.T)) @ d.T
        gen_eager = model.generate(ids[:1, :32], max_new_tokens=32, min_new_tokens=32, do_sample=False)
        report = apply_fused_mlp(model)
        fused = model(ids).logits.float()
        mlp_fused = {idx: layer.mlp(mlp_in[idx]).float() for idx, layer in enumerate(model.model.layers)}
        gen_fused = model.generate(ids[:1, :32], max_new_tokens=32, min_new_tokens=32, do_sample=False)
    res = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
        commit=args.commit, layers=args.layers, batch=args.batch, seq=args.seq, patched=len(report.patched),
        fused_vs_eager_bf16_max_abs=(fused - eager).abs().max().item(),
        fused_vs_eager_bf16_rel=rel(fused, eager),
        eager_bf16_vs_fp32_rel=rel(eager, ref32),
        fused_bf16_vs_fp32_rel=rel(fused, ref32),
        top1_agreement_fused_vs_eager=(fused.argmax(-1) == eager.argmax(-1)).float().mean().item(),
        top1_agreement_fused_vs_fp32=(fused.argmax(-1) == ref32.argmax(-1)).float().mean().item(),
        top1_agreement_eager_vs_fp32=(eager.argmax(-1) == ref32.argmax(-1)).float().mean().item(),
        greedy_32_tokens_identical=bool(torch.equal(gen_eager, gen_fused)),
        logit_abs_max=eager.abs().max().item(),
        mlp_eager_bf16_vs_fp32_rel=[rel(mlp_eager[i], mlp_ref[i]) for i in sorted(mlp_ref)],
        mlp_fused_bf16_vs_fp32_rel=[rel(mlp_fused[i], mlp_ref[i]) for i in sorted(mlp_ref)],
    )
    unpatch(model)
    res["ok"] = res["fused_bf16_vs_fp32_rel"] <= 1.5 * res["eager_bf16_vs_fp32_rel"] + 1e-3 and all(
        f <= 1.5 * e + 1e-3 for f, e in zip(res["mlp_fused_bf16_vs_fp32_rel"], res["mlp_eager_bf16_vs_fp32_rel"])
    )
    (args.out / "validate_model.json").write_text(json.dumps(res, indent=1))
    for key, val in res.items():
        print(f"{key:34s} {val}")
    if not res["ok"]:
        raise SystemExit("fused logits are further from the fp32 reference than eager bf16's")


if __name__ == "__main__":
    main()
