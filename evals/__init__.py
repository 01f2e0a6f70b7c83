"""Accuracy harness of swiglu-patch (installed as ``swiglu_patch.evals``): does the model
still answer the same once its MLPs are fused?

- `run_eval`: the whole ``swiglu-patch eval`` as a function: lm-eval tasks eager vs fused,
  paired per question (McNemar, flips, log-likelihood changes, detectable differences),
  plus token-level agreement on text; writes report.json and report.md.
- `prepare_tasks` / `compare_on_tasks`: the lm-eval part alone, on a loaded model.
- `make_windows` / `compare_tokens`: the token-level part alone.
- `Patcher`: how the fused model is made (default: `apply_fused_mlp`); `IdentityPatcher`
  compares a model with itself.
- ``python -m swiglu_patch.evals.mmlu_to_pro``: MMLU -> MMLU-Pro schema, for offline runs.
- ``python -m swiglu_patch.evals.lm_eval_main``: lm-eval's CLI with model type
  ``hf-fused-mlp`` registered (`lm_model`).

lm-eval is imported only when a task runs; the token-level check needs only transformers.
See docs/accuracy.md.
"""

from .errors import EvalSetupError
from .harness import TaskPlan, compare_on_tasks, prepare_tasks
from .patching import IdentityPatcher, Patcher, load_model
from .runner import run_eval
from .token_agreement import compare_tokens, load_text, make_windows

__all__ = [
    "EvalSetupError",
    "IdentityPatcher",
    "Patcher",
    "TaskPlan",
    "compare_on_tasks",
    "compare_tokens",
    "load_model",
    "load_text",
    "make_windows",
    "prepare_tasks",
    "run_eval",
]
