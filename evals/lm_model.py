"""lm-eval model type ``hf-fused-mlp``: lm-eval's own HF model with the fused MLP applied.

    python -m swiglu_patch.evals.lm_eval_main run --model hf-fused-mlp \
        --model_args pretrained=google/gemma-3-270m,dtype=bfloat16 --tasks leaderboard_mmlu_pro

Importing this module registers the type in lm-eval's model registry; everything but the
patch is `lm_eval.models.huggingface.HFLM`, unchanged: loading, batching, tokenization and
scoring. Extra model_args: ``fused_backend`` (auto | triton | torch, default auto: Triton
on CUDA, PyTorch reference elsewhere) and ``fused_strict`` (default True: refuse a model
with any gated MLP that cannot be patched).
"""

from __future__ import annotations

import logging

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

log = logging.getLogger("lm_eval.models.hf_fused_mlp")  # shown by lm-eval's logging setup

MODEL_NAME = "hf-fused-mlp"


def _as_bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{MODEL_NAME}: fused_strict must be true or false, got {value!r}")
    return bool(value)


@register_model(MODEL_NAME)
class FusedMLPLM(HFLM):
    """`HFLM` whose model has every gated MLP replaced by swiglu-patch's fused module.

    Args:
        fused_backend: `apply_fused_mlp` backend.
        fused_strict: `apply_fused_mlp` strictness.
        *args, **kwargs: as for `HFLM`.

    Attributes:
        fused_report: the `PatchReport` of the patch.
    """

    def __init__(self, *args, fused_backend: str = "auto", fused_strict: bool | str = True, **kwargs):
        super().__init__(*args, **kwargs)
        from swiglu_patch import apply_fused_mlp

        self.fused_report = apply_fused_mlp(self.model, strict=_as_bool(fused_strict), backend=fused_backend)
        log.info("%s: %s", MODEL_NAME, self.fused_report)
