"""`run_eval`: the whole `swiglu-patch eval`, as one Python function.

Order, so that bad input fails before anything is evaluated or written: check the model's
source (a local path, or a hub id that can be fetched now) and the backend against the
device; check tasks and local files (and build the tasks once); read the text; load the
model; patch and unpatch it once (an unpatchable model stops here); cut the text into
windows. Then the token-level comparison, then lm-eval eager, reference and fused, then the reports. The
model is loaded once and patched in place between the runs (see `patching.py` for why), and
is left unpatched on return. A setup failure removes the output folder if this call made it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from swiglu_patch.provenance import environment

from .config import EvalConfig
from .errors import EvalSetupError
from .harness import TaskPlan, compare_on_tasks, prepare_tasks
from .patching import Patcher, load_model, model_summary
from .preflight import preflight
from .report import task_verdict, terminal_summary, to_markdown, token_verdict, write_json
from .token_agreement import compare_tokens, load_text, make_windows

REPORT_SCHEMA = "swiglu-patch/accuracy-report/3"  # 3: each row carries its checks (verdicts.py)


@dataclass
class _Prepared:
    """A checked run: the loaded model and everything cut and built for it."""

    name: str
    model: object
    tokenizer: object
    load_s: float
    patch_report: str
    plan: TaskPlan | None
    windows: object


def run_eval(model, config: EvalConfig, *, tokenizer=None, patcher: Patcher | None = None) -> dict:
    """Compare a model eager vs fused on lm-eval tasks and/or token by token on text.

    Args:
        model: local checkpoint folder or hub id (loaded as ``config.load`` says), or a loaded
            causal LM on its evaluation device (then `tokenizer` is required).
        config: what to run (`EvalConfig`).
        tokenizer: the tokenizer of a loaded model.
        patcher: how the fused model is made (default ``Patcher(config.load.backend,
            config.load.strict)``; tests pass an `IdentityPatcher` or a broken one).

    Returns:
        The report dict, also written to ``output_dir/report.json`` and ``report.md``.

    Raises:
        EvalSetupError: bad input, raised before any evaluation.
    """
    patcher = patcher or Patcher(backend=config.load.backend, strict=config.load.strict)
    out = Path(config.output_dir)
    made_out = not out.exists()
    t_start = time.perf_counter()
    try:
        run = _prepare(model, tokenizer, config, patcher, out)
    except BaseException:
        if made_out and out.is_dir():
            shutil.rmtree(out)
        raise
    report = _evaluate(run, config, patcher, out)
    report["timing"]["total_s"] = time.perf_counter() - t_start
    report["files"] = {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
    write_json(report, out / "report.json")
    (out / "report.md").write_text(to_markdown(report), encoding="utf-8")
    if config.print_summary:
        print(terminal_summary(report), flush=True)
    return report


def _prepare(model, tokenizer, config: EvalConfig, patcher: Patcher, out: Path) -> _Prepared:
    """Every check that can fail, in the module docstring's order; loads the model."""
    load = config.load
    if not isinstance(model, (str, Path)) and tokenizer is None:
        raise EvalSetupError("a loaded model needs its tokenizer: run_eval(model, config, tokenizer=...)")
    loaded_on = None if isinstance(model, (str, Path)) else str(next(model.parameters()).device)
    preflight(model, config, loaded_on, patcher.backend)
    plan = prepare_tasks(config.tasks.names, config.tasks.local_data, out) if config.tasks else None
    body = None
    if config.text is not None:
        body = load_text(config.text.path, config.text.dataset, config.text.split, config.text.column)
    if isinstance(model, (str, Path)):
        t0 = time.perf_counter()
        name = str(model)
        lm, tok = load_model(name, load.dtype, load.device, load.gguf_file)
        load_s = time.perf_counter() - t0
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
        lm, tok, load_s = model, tokenizer, 0.0
    _check_interpreter_dtype(patcher.backend, lm)
    patch_report = patcher.check(lm)
    windows = make_windows(tok, body, config.text.window, config.text.max_tokens) if body is not None else None
    return _Prepared(name, lm, tok, load_s, patch_report, plan, windows)


def _evaluate(run: _Prepared, config: EvalConfig, patcher: Patcher, out: Path) -> dict:
    """The token-level comparison, then the lm-eval runs; the report without its files."""
    out.mkdir(parents=True, exist_ok=True)
    lm, th = run.model, config.thresholds
    report = {
        "schema": REPORT_SCHEMA,
        "model": {"name": run.name, **model_summary(lm)},
        "fused_path": patcher.path(lm),
        "patcher": patcher.name,
        "patch_report": run.patch_report,
        "config": config.to_dict(),
        "environment": environment(str(next(lm.parameters()).device)),
        "local_data": run.plan.local if run.plan else {},
        "rows": [],
        "tokens": None,
        "timing": {"load_s": run.load_s},
    }
    if run.windows is not None:
        text = config.text
        tokens = compare_tokens(lm, run.windows, patcher=patcher, batch_size=text.batch_size,
                                reference_dtype=_reference(text.reference_dtype, lm), progress=config.progress)
        tokens["source"] = text.source
        tokens["verdict"] = token_verdict(tokens, th.top1_min, th.kl_max, th.ratio_max, th.tail_ratio)
        report["tokens"] = tokens
    if run.plan is not None:
        try:
            res = compare_on_tasks(lm, run.tokenizer, run.plan, out, config.tasks, patcher=patcher,
                                   alpha=th.alpha, power=th.power,
                                   reference_dtype=_reference(config.tasks.reference_dtype, lm),
                                   verdict=th.question_options())
        finally:
            patcher.restore(lm)
        for row in res["rows"]:
            row["verdict"] = task_verdict(row, th.alpha)
        report["rows"] = res["rows"]
        report["timing"].update({f"{k}_s": v["seconds"] for k, v in res["runs"].items()})
    return report


def _check_interpreter_dtype(backend: str, model) -> None:
    """Triton's interpreter computes bf16 dot products wrongly (triton 3.9): refuse, not mislead."""
    import torch

    p = next(model.parameters())
    if backend == "triton" and p.device.type != "cuda" and p.dtype == torch.bfloat16:
        raise EvalSetupError(
            "--backend triton on CPU runs Triton's interpreter, whose bf16 tl.dot is wrong; "
            "load the model with --dtype float32 (or float16)"
        )


def _reference(name: str, model):
    """The torch dtype of the token-level reference run, or None."""
    import torch

    if name == "auto":
        low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if low else torch.float64
    return {"none": None, "float32": torch.float32, "float64": torch.float64}[name]
