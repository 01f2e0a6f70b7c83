"""lm-eval's own command line, with the ``hf-fused-mlp`` model type registered.

    python -m swiglu_patch.evals.lm_eval_main run --model hf-fused-mlp \
        --model_args pretrained=PATH_OR_ID --tasks TASKS [any lm-eval option]

lm-eval 0.4.13 finds model types only in its registry, filled by imports; the plain
``lm_eval`` command never imports swiglu-patch, so this wrapper imports `lm_model` (which
registers the type) and then hands the arguments to lm-eval's CLI unchanged.
"""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import lm_model  # noqa: F401  (registers hf-fused-mlp)

    cli_evaluate()


if __name__ == "__main__":
    main()
