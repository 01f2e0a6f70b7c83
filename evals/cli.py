"""`swiglu-patch eval`: the options, the `EvalConfig` they make, and the exit status.

Defining the options imports nothing heavy (``swiglu-patch eval --help`` stays fast); torch,
transformers and lm-eval load only when `main` runs.
"""

from __future__ import annotations

import argparse
import sys

from swiglu_patch.inputs import fraction, nonnegative_float, nonnegative_int, one_line, open_fraction, positive_int

from .config import BACKENDS, DTYPES, REFERENCE_DTYPES, EvalConfig, LoadOptions, TaskOptions, TextOptions, Thresholds
from .errors import EvalSetupError
from .preflight import preflight

DESCRIPTION = """\
Run a model as it is (eager) and with its MLPs fused, on the same questions and the same
text, and say per task whether any answer changed, and how small a change the run could
have seen. Two checks, either or both:
  --tasks     lm-eval tasks, paired question by question (needs lm-eval: pip install lm_eval)
  --text      token-level agreement on a text: KL, top-1 agreement, perplexity of both
"""

EPILOG = """\
examples:
  swiglu-patch eval --model google/gemma-3-270m --dtype bfloat16 --tasks gpqa_diamond_zeroshot
  swiglu-patch eval --model ./ckpt --text book.txt --window 512 --max-tokens 65536
  swiglu-patch eval --model ./ckpt --tasks leaderboard_mmlu_pro --local-data leaderboard_mmlu_pro=data/mmlu_as_pro

offline (no hub): set HF_HUB_OFFLINE=1, give --model a local folder and point each task at
local files with --local-data (python -m swiglu_patch.evals.mmlu_to_pro makes MMLU-Pro files).

writes report.json, report.md, samples/<task>.jsonl and lm-eval's raw results to --output-dir.
verdicts (docs/accuracy.md): per task, accuracy (McNemar), answers and log-likelihood shifts
against the noise floor of a reference run; per text, the KL and its tail against that floor.
exit status: 0 done; 1 a verdict says DIFFERENCE and --fail-on-difference was given;
2 bad input (nothing was evaluated).
"""


def _limit(text: str) -> int | float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction between 0 and 1, got {text!r}") from None
    if x >= 1 and x == int(x):
        return int(x)
    if 0 < x < 1:
        return x
    raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction between 0 and 1, got {text!r}")


def _ratio(text: str) -> float:
    value = nonnegative_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 (fused no worse than eager), got {text!r}")
    return value


def _batch(text: str) -> int | str:
    if text == "auto" or text.startswith("auto:"):
        return text
    return positive_int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch eval`'s options to `parser`."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=True, help="local checkpoint folder, or a hub id (owner/name)")
    g.add_argument("--gguf-file", default=None, metavar="NAME", help="a GGUF file inside --model (needs the gguf package)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="weights and activations (default: the checkpoint's)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    g.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="fused computation: auto = the Triton kernel on CUDA, the PyTorch reference elsewhere; "
                        "triton on CPU needs TRITON_INTERPRET=1 and --dtype float32")
    g.add_argument("--no-strict", action="store_true", help="skip MLPs that cannot be fused instead of refusing the model")
    g = parser.add_argument_group("lm-eval tasks")
    g.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                   help="lm-eval task, group or tag names, space or comma separated (list them: lm-eval ls tasks)")
    g.add_argument("--local-data", action="append", default=None, metavar="TASK=PATH",
                   help="read TASK (or every task of a group) from local files in the original schema "
                        "(MMLU-Pro JSONL, GPQA CSV); repeatable")
    g.add_argument("--limit", type=_limit, default=None, help="questions per task (or a fraction < 1)")
    g.add_argument("--batch-size", type=_batch, default=1, help="lm-eval batch size: an integer or auto (default 1)")
    g.add_argument("--num-fewshot", type=nonnegative_int, default=None, help="few-shot examples (default: each task's own)")
    g.add_argument("--seed", type=int, default=0, help="seed of both runs: python, numpy, torch, few-shot (default 0)")
    g.add_argument("--gen-kwargs", default=None, metavar="K=V,...", help="generation overrides, e.g. max_gen_toks=256")
    g.add_argument("--apply-chat-template", action="store_true", help="wrap prompts in the model's chat template")
    g = parser.add_argument_group("token-level agreement")
    g.add_argument("--text", default=None, metavar="FILE", help="a UTF-8 text file")
    g.add_argument("--text-dataset", default=None, metavar="DATASET",
                   help="or a dataset: a local .jsonl/.csv/.parquet/.txt file, or a hub id")
    g.add_argument("--text-split", default="train", help="its split (default train)")
    g.add_argument("--text-column", default="text", help="its text column (default text)")
    g.add_argument("--window", type=positive_int, default=512, help="tokens per window (default 512)")
    g.add_argument("--max-tokens", type=positive_int, default=None, help="compare at most this many tokens")
    g.add_argument("--text-batch-size", type=positive_int, default=8, help="windows per forward pass (default 8)")
    g.add_argument("--reference-dtype", default="auto", choices=REFERENCE_DTYPES,
                   help="the noise floor of both verdicts: also run the unpatched model in this dtype, on the text "
                        "and on the tasks (auto: float32 for a bf16/fp16 model, float64 for float32; none: absolute "
                        "thresholds instead)")
    g = parser.add_argument_group("report")
    g.add_argument("--output-dir", default="swiglu_eval", metavar="DIR",
                   help="report.json, report.md, samples/ go here (default swiglu_eval)")
    g.add_argument("--alpha", type=open_fraction, default=0.05,
                   help="false-alarm level of the per-question verdict, split over its checks (default 0.05)")
    g.add_argument("--power", type=open_fraction, default=0.8, help="power of the detectable differences (default 0.8)")
    g.add_argument("--top1-min", type=fraction, default=0.999,
                   help="token verdict without a reference: least top-1 agreement (default 0.999)")
    g.add_argument("--kl-max", type=nonnegative_float, default=1e-4,
                   help="token verdict without a reference: largest mean KL, nats/token (default 1e-4)")
    g.add_argument("--ratio-max", type=_ratio, default=1.2,
                   help="token verdict: largest mean KL(ref||fused) / mean KL(ref||eager) (default 1.2)")
    g.add_argument("--tail-ratio", type=_ratio, default=4.0,
                   help="token verdict: largest p99 and max of KL(eager||fused) over those of KL(ref||eager) (default 4)")
    g.add_argument("--answer-ratio", type=_ratio, default=1.25,
                   help="per question: how many times eager's departures from the reference answers fused may have "
                        "(default 1.25)")
    g.add_argument("--loglik-ratio", type=_ratio, default=2.0,
                   help="per question: a log-likelihood shift from the reference counts against fused above this "
                        "many times eager's (default 2)")
    g.add_argument("--change-max", type=open_fraction, default=0.05,
                   help="per question without a reference: share of answers fused may change (default 0.05)")
    g.add_argument("--fail-on-difference", action="store_true", help="exit 1 if any verdict is DIFFERENCE")


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The `EvalConfig` that `swiglu-patch eval`'s options describe.

    Raises:
        EvalSetupError: a combination of options that cannot run (no task and no text, both
            --text and --text-dataset, ...).
    """
    names = [t for v in args.tasks or [] for t in v.split(",") if t]
    tasks = None
    if args.tasks is not None:
        tasks = TaskOptions(
            names=tuple(names), local_data=tuple(args.local_data or ()), limit=args.limit, batch_size=args.batch_size,
            num_fewshot=args.num_fewshot, seed=args.seed, gen_kwargs=args.gen_kwargs,
            apply_chat_template=args.apply_chat_template, reference_dtype=args.reference_dtype,
        )
    elif args.local_data:
        raise EvalSetupError("--local-data points tasks at files, but no --tasks were given")
    text = None
    if args.text is not None or args.text_dataset is not None:
        text = TextOptions(
            path=args.text, dataset=args.text_dataset, split=args.text_split, column=args.text_column,
            window=args.window, max_tokens=args.max_tokens, batch_size=args.text_batch_size,
            reference_dtype=args.reference_dtype,
        )
    return EvalConfig(
        output_dir=args.output_dir,
        load=LoadOptions(dtype=args.dtype, device=args.device, gguf_file=args.gguf_file, backend=args.backend,
                         strict=not args.no_strict),
        tasks=tasks,
        text=text,
        thresholds=Thresholds(alpha=args.alpha, power=args.power, top1_min=args.top1_min, kl_max=args.kl_max,
                              ratio_max=args.ratio_max, tail_ratio=args.tail_ratio, answer_ratio=args.answer_ratio,
                              loglik_ratio=args.loglik_ratio, change_max=args.change_max),
    )


def main(args: argparse.Namespace) -> int:
    """Run `swiglu-patch eval` with parsed `args`; returns the exit status."""
    try:
        config = config_from_args(args)
        preflight(args.model, config)  # fails fast: before torch, transformers and lm-eval load
        from swiglu_patch import PatchError

        from .runner import run_eval

        try:
            report = run_eval(args.model, config)
        except PatchError as err:
            raise EvalSetupError(str(err)) from None
    except (EvalSetupError, ImportError) as err:
        print(f"swiglu-patch eval: error: {one_line(err)}", file=sys.stderr)
        return 2
    labels = [r["verdict"]["label"] for r in report["rows"]]
    if report.get("tokens"):
        labels.append(report["tokens"]["verdict"]["label"])
    return 1 if args.fail_on_difference and "DIFFERENCE" in labels else 0
