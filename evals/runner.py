"""`run_eval`: the whole `swiglu-patch eval`, as one Python function.

Order, so that bad input fails before anything is evaluated: check tasks and local files
(and build the tasks once), read the text, load the model, patch and unpatch it once (an
unpatchable model stops here), cut the text into windows; then the token-level comparison,
then lm-eval eager and fused; then the reports. The model is loaded once and patched in
place between the runs (see `patching.py` for why), and is left unpatched on return.
"""

from __future__ import annotations

import time
from pathlib import Path

from .environment import environment
from .errors import EvalSetupError
from .harness import compare_on_tasks, prepare_tasks
from .patching import Patcher, load_model, model_summary
from .report import task_verdict, terminal_summary, to_markdown, token_verdict, write_json
from .token_agreement import compare_tokens, load_text, make_windows

REPORT_SCHEMA = "swiglu-patch/accuracy-report/1"


def _reference(name: str, model):
    """The torch dtype of the token-level reference run, or None."""
    import torch

    names = {"none": None, "float32": torch.float32, "float64": torch.float64}
    if name == "auto":
        low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if low else None
    if name not in names:
        raise EvalSetupError(f"reference dtype must be auto, none, float32 or float64, got {name!r}")
    return names[name]


def run_eval(
    model,
    *,
    tasks: list[str] | None = None,
    output_dir: str | Path = "swiglu_eval",
    tokenizer=None,
    dtype: str = "auto",
    device: str | None = None,
    gguf_file: str | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    num_fewshot: int | None = None,
    seed: int = 0,
    gen_kwargs: str | dict | None = None,
    local_data: list[str] | dict | None = None,
    apply_chat_template: bool = False,
    text: str | None = None,
    text_dataset: str | None = None,
    text_split: str = "train",
    text_column: str = "text",
    window: int = 512,
    max_tokens: int | None = None,
    text_batch_size: int = 8,
    reference_dtype: str = "auto",
    backend: str = "auto",
    strict: bool = True,
    patcher: Patcher | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
    top1_min: float = 0.999,
    kl_max: float = 1e-4,
    ratio_max: float = 2.0,
    print_summary: bool = True,
) -> dict:
    """Compare a model eager vs fused on lm-eval tasks and/or token by token on text.

    Args:
        model: local checkpoint folder or hub id, or a loaded causal LM (then `tokenizer`).
        tasks: lm-eval task/group/tag names (None: token-level check only).
        output_dir: report.json, report.md, samples/ and lm-eval's raw results go here.
        tokenizer: the tokenizer when `model` is a loaded model.
        dtype: "auto", "float32", "bfloat16" or "float16" (loading from a path/id only).
        device: "cpu", "cuda", ... (default cuda when available; loading only).
        gguf_file: GGUF file name inside `model` (loading only).
        limit: lm-eval limit per task (count, or fraction if < 1).
        batch_size: lm-eval batch size.
        num_fewshot: few-shot override (None: each task's default).
        seed: seed for both runs (python, numpy, torch, few-shot sampler).
        gen_kwargs: generation overrides for generative tasks, e.g. "max_gen_toks=256".
        local_data: ``TASK=PATH`` items pointing tasks at local files (`local_tasks.py`).
        apply_chat_template: lm-eval's chat-template flag.
        text: a UTF-8 text file for the token-level check.
        text_dataset: or a dataset (local file or hub id) ...
        text_split: ... its split ...
        text_column: ... and text column.
        window: tokens per window for the token-level check.
        max_tokens: cap on tokens compared (whole windows).
        text_batch_size: windows per forward pass.
        reference_dtype: token-level reference run: "auto" (float32 for a bf16/fp16
            model, none for float32), "none", "float32" or "float64".
        backend: apply_fused_mlp backend ("auto", "triton", "torch").
        strict: apply_fused_mlp strictness.
        patcher: replaces the default `Patcher(backend, strict)` (tests, experiments).
        alpha: significance level of the paired tests.
        power: power for the minimum detectable differences.
        top1_min: token-level verdict without reference: least top-1 agreement.
        kl_max: token-level verdict without reference: largest mean KL (nats/token).
        ratio_max: token-level verdict with reference: largest KL(ref||fused) / KL(ref||eager).
        print_summary: print the verdicts when done.

    Returns:
        The report dict (also written to output_dir/report.json and report.md).

    Raises:
        EvalSetupError: bad input, raised before any evaluation.
    """
    if not tasks and text is None and text_dataset is None:
        raise EvalSetupError("nothing to do: give --tasks, --text FILE or --text-dataset DATASET")
    if reference_dtype not in ("auto", "none", "float32", "float64"):
        raise EvalSetupError(f"reference dtype must be auto, none, float32 or float64, got {reference_dtype!r}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    patcher = patcher or Patcher(backend=backend, strict=strict)
    t_start = time.perf_counter()
    plan = prepare_tasks(tasks, local_data, out) if tasks else None
    source = None
    if text is not None or text_dataset is not None:
        body = load_text(text, text_dataset, text_split, text_column)
        source = text if text is not None else f"{text_dataset} [{text_split}].{text_column}"
    if isinstance(model, (str, Path)):
        name = str(model)
        t0 = time.perf_counter()
        lm, tok = load_model(name, dtype, device, gguf_file)
        load_s = time.perf_counter() - t0
    else:
        if tokenizer is None:
            raise EvalSetupError("a loaded model needs its tokenizer: pass tokenizer=...")
        lm, tok, load_s = model, tokenizer, 0.0
        name = getattr(getattr(lm, "config", None), "_name_or_path", None) or type(lm).__name__
    patch_text = patcher.check(lm)
    windows = make_windows(tok, body, window, max_tokens) if source else None
    dev = str(next(lm.parameters()).device)

    report = {
        "schema": REPORT_SCHEMA,
        "model": {"name": name, **model_summary(lm)},
        "fused_path": patcher.path(lm),
        "patch_report": patch_text,
        "settings": {
            "tasks": tasks, "limit": limit, "batch_size": batch_size, "num_fewshot": num_fewshot, "seed": seed,
            "gen_kwargs": gen_kwargs, "apply_chat_template": apply_chat_template, "backend": backend,
            "patcher": patcher.name, "alpha": alpha, "power": power,
            "window": window if source else None, "max_tokens": max_tokens if source else None,
            "reference_dtype": reference_dtype if source else None,
        },
        "environment": environment(dev),
        "local_data": plan.local if plan else {},
        "rows": [],
        "tokens": None,
        "timing": {"load_s": load_s},
    }
    if windows is not None:
        tokens = compare_tokens(lm, windows, patcher=patcher, batch_size=text_batch_size,
                                reference_dtype=_reference(reference_dtype, lm))
        tokens["source"] = source
        tokens["verdict"] = token_verdict(tokens, top1_min, kl_max, ratio_max)
        report["tokens"] = tokens
    if plan is not None:
        try:
            res = compare_on_tasks(
                lm, tok, plan, out, patcher=patcher, limit=limit, batch_size=batch_size, num_fewshot=num_fewshot,
                seed=seed, gen_kwargs=gen_kwargs, apply_chat_template=apply_chat_template, alpha=alpha, power=power,
            )
        finally:
            patcher.restore(lm)
        for row in res["rows"]:
            row["verdict"] = task_verdict(row, alpha)
        report["rows"] = res["rows"]
        report["timing"].update({f"{k}_s": v["seconds"] for k, v in res["runs"].items()})
    report["timing"]["total_s"] = time.perf_counter() - t_start
    report["files"] = {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
    write_json(report, out / "report.json")
    (out / "report.md").write_text(to_markdown(report), encoding="utf-8")
    if print_summary:
        print(terminal_summary(report), flush=True)
    return report
