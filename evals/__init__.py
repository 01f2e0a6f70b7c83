"""Accuracy harness of swiglu-patch (installed as ``swiglu_patch.evals``): does the model
still answer the same once its MLPs are fused?

- `run_eval(model, EvalConfig(...))`: the whole ``swiglu-patch eval`` as a function: lm-eval
  tasks eager, reference and fused, paired per question (McNemar, answers and log-likelihood
  shifts against the reference's noise floor, detectable differences), plus token-level
  agreement on text; writes report.json and report.md. `EvalConfig` groups `LoadOptions`,
  `TaskOptions`, `TextOptions`, `Thresholds`.
- ``swiglu_patch.evals.verdicts``: the verdicts as plain functions over per-question and
  per-token numbers (`question_checks`, `token_check`), for any pairwise comparison.
- ``swiglu_patch.evals.defects`` / ``python -m swiglu_patch.evals.power``: planted defects and
  the table of which verdict sees which (the real-model extra's Gemma 3 270M).
- `prepare_tasks` / `compare_on_tasks`: the lm-eval part alone, on a loaded model.
- `make_windows` / `compare_tokens`: the token-level part alone.
- `Patcher`: how the fused model is made (default: `apply_fused_mlp`); `IdentityPatcher`
  compares a model with itself.
- ``python -m swiglu_patch.evals.mmlu_to_pro``: MMLU -> MMLU-Pro schema, for offline runs.
- ``python -m swiglu_patch.evals.lm_eval_main``: lm-eval's CLI with model type
  ``hf-fused-mlp`` registered (`lm_model`).

The names load on first use, so the command line's option parsing imports no torch; lm-eval
is imported only when a task runs, and the token-level check needs only transformers.
See docs/accuracy.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module of this package that defines it
_EXPORTS = {
    "EvalConfig": ".config",
    "LoadOptions": ".config",
    "TaskOptions": ".config",
    "TextOptions": ".config",
    "Thresholds": ".config",
    "EvalSetupError": ".errors",
    "TaskPlan": ".harness",
    "compare_on_tasks": ".harness",
    "prepare_tasks": ".harness",
    "IdentityPatcher": ".patching",
    "Patcher": ".patching",
    "load_model": ".patching",
    "run_eval": ".runner",
    "compare_tokens": ".token_agreement",
    "load_text": ".token_agreement",
    "make_windows": ".token_agreement",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from .config import EvalConfig, LoadOptions, TaskOptions, TextOptions, Thresholds
    from .errors import EvalSetupError
    from .harness import TaskPlan, compare_on_tasks, prepare_tasks
    from .patching import IdentityPatcher, Patcher, load_model
    from .runner import run_eval
    from .token_agreement import compare_tokens, load_text, make_windows


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swiglu_patch.evals' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
