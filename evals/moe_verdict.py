"""The verdicts on an MoE model, eager against fused, with the routing decisions that differ.

`measure_moe` is `power.measure` for one patcher, plus a `routing.RoutingRecorder` on every run:
eager, the reference (the model cast in place to a higher precision: the noise floor) and fused,
on the same question prompts and text windows. Besides both verdicts (`question_checks`,
`token_check`) it reports how many routing decisions fused makes differently from eager, and,
as their noise floor, how many eager makes differently from the reference.

`full_vocab_nll` scores text over the whole vocabulary for a model whose vocabulary was cut to
the ids a text uses (`gguf_slice`): its final hidden states times the full embedding matrix.
"""

from __future__ import annotations

import time

import torch

from .patching import Patcher
from .power import kl_per_position, score_questions
from .routing import RoutingRecorder, routing_flips
from .token_agreement import _cast_floating
from .verdicts import kl_stats, question_checks, token_check


@torch.inference_mode()
def _logits(model, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    dev = next(model.parameters()).device
    return torch.cat([model(input_ids=windows[i : i + batch].to(dev)).logits.double().cpu()
                      for i in range(0, len(windows), batch)])


def _run(model, prompts, choice_ids, windows) -> dict:
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    with RoutingRecorder(model) as rec:
        answers, logliks = score_questions(model, [p.to(dev) for p in prompts], choice_ids)
        logits = _logits(model, windows)
    return {"answers": answers, "logliks": logliks, "logits": logits, "routes": rec.calls,
            "seconds": time.perf_counter() - t0}


def measure_moe(model, prompts: list[torch.Tensor], choice_ids: list[int], answer_key: list[int],
                windows: torch.Tensor, patcher: Patcher, *, reference_dtype: torch.dtype = torch.float32,
                alpha: float = 0.05) -> dict:
    """Eager, the reference and fused runs of an MoE model; both verdicts and the routing flips.

    Args:
        model: an MoE causal LM with router modules (`RoutingRecorder`), unpatched, eval mode.
        prompts: int64 [L] token ids per question; choice_ids: the one-token answers' ids;
            answer_key: the right choice per question.
        windows: int64 [windows, window] token ids of text.
        patcher: makes the fused model (e.g. `Patcher(backend="auto")`).
        reference_dtype: the reference run's dtype (float32 for a bf16 model).
        alpha: the per-question verdict's level.

    Returns:
        {"n", "same_answers": {fused_vs_eager, eager_vs_reference, fused_vs_reference} (counts),
        "questions": question_checks(...), "tokens": token_check(...), "kl": {fused_vs_eager,
        noise, fused_vs_reference}, "routing": {eager_vs_fused, eager_vs_reference,
        fused_vs_reference} (`routing_flips`), "seconds": per run, "patch": the patch report}.
    """
    eager = _run(model, prompts, choice_ids, windows)
    old = _cast_floating(model, reference_dtype)
    try:
        ref = _run(model, prompts, choice_ids, windows)
    finally:
        _cast_floating(model, old)
    text = patcher.apply(model)
    try:
        fused = _run(model, prompts, choice_ids, windows)
    finally:
        patcher.restore(model)
    d = kl_stats(kl_per_position(eager["logits"], fused["logits"]))
    d["top1_agreement"] = (eager["logits"].argmax(-1) == fused["logits"].argmax(-1)).double().mean().item()
    d["max_abs_logit_diff"] = (eager["logits"] - fused["logits"]).abs().max().item()
    noise = kl_stats(kl_per_position(ref["logits"], eager["logits"]))
    f = kl_stats(kl_per_position(ref["logits"], fused["logits"]))
    same = lambda x, y: sum(a == b for a, b in zip(x["answers"], y["answers"]))  # noqa: E731
    right = {"acc": ([float(a == k) for a, k in zip(eager["answers"], answer_key)],
                     [float(a == k) for a, k in zip(fused["answers"], answer_key)])}
    return {
        "n": len(prompts),
        "same_answers": {"fused_vs_eager": same(fused, eager), "eager_vs_reference": same(eager, ref),
                         "fused_vs_reference": same(fused, ref)},
        "accuracy": {"eager": sum(right["acc"][0]) / len(prompts), "fused": sum(right["acc"][1]) / len(prompts)},
        "questions": question_checks(alpha=alpha, eager=eager["answers"], fused=fused["answers"],
                                     reference=ref["answers"], right=right,
                                     logliks=(eager["logliks"], fused["logliks"], ref["logliks"])),
        "tokens": token_check(d, noise, f),
        "kl": {"fused_vs_eager": d, "noise": noise, "fused_vs_reference": f},
        "routing": {"eager_vs_fused": routing_flips(eager["routes"], fused["routes"]),
                    "eager_vs_reference": routing_flips(eager["routes"], ref["routes"]),
                    "fused_vs_reference": routing_flips(fused["routes"], ref["routes"])},
        "seconds": {"eager": eager["seconds"], "reference": ref["seconds"], "fused": fused["seconds"]},
        "patch": text,
    }


@torch.inference_mode()
def final_hidden(model, windows: torch.Tensor) -> torch.Tensor:
    """float32 [windows, window, hidden]: the final-normed hidden states (``model.model(...)``)."""
    dev = next(model.parameters()).device
    return torch.cat([model.model(input_ids=w[None].to(dev)).last_hidden_state.float().cpu() for w in windows])


def full_vocab_nll(hidden: dict[str, torch.Tensor], targets: torch.Tensor, embedding: torch.Tensor,
                   bases: tuple[str, ...]) -> dict:
    """Perplexity of each model over the full vocabulary, and its mean KL from each base model's predictions.

    For models whose vocabulary was cut to the ids a text uses (`gguf_slice`): with tied
    embeddings and no final soft-capping, the full logits are the final hidden states times the
    full embedding matrix.

    Args:
        hidden: {name: float32 [windows, window, hidden]} (`final_hidden`).
        targets: int64 [windows, window]: the windows' tokens as ids of the full vocabulary.
        embedding: float32 [V, hidden], the full vocabulary's embedding (= the LM head).
        bases: names of `hidden` to measure KL(base || model) from.

    Returns:
        {name: {"ppl", "nll", "kl_from": {base: mean KL, nats per position}, "positions"}}:
        next-token NLL within each window, float64.
    """
    nll = dict.fromkeys(hidden, 0.0)
    kl = {k: dict.fromkeys(bases, 0.0) for k in hidden}
    n = 0
    for w, t in enumerate(targets):
        logprobs = lambda k: torch.log_softmax((hidden[k][w, :-1] @ embedding.T).double(), -1)  # noqa: E731
        base_lp = {b: logprobs(b) for b in bases}
        for k in hidden:
            lp = base_lp[k] if k in base_lp else logprobs(k)
            nll[k] += -lp.gather(-1, t[1:, None]).sum().item()
            for b, lb in base_lp.items():
                kl[k][b] += (lb.exp() * (lb - lp)).sum().item()
        n += len(t) - 1
    return {k: {"ppl": float(torch.tensor(nll[k] / n, dtype=torch.float64).exp()), "nll": nll[k] / n,
                "kl_from": {b: v / n for b, v in kl[k].items()}, "positions": n} for k in hidden}
