"""`swiglu-patch eval`: eager against fused on lm-eval tasks and token by token on text.

    swiglu-patch eval --model google/gemma-3-270m --tasks leaderboard_mmlu_pro gpqa_diamond_zeroshot \\
        --dtype bfloat16 --batch-size 8 --output-dir out/
    swiglu-patch eval --model ./ckpt --tasks mmlu_pro --local-data mmlu_pro=data/mmlu_pro/   # offline
    swiglu-patch eval --model ./ckpt --text austen.txt --window 512 --max-tokens 8192

Writes report.json, report.md, samples/<task>.jsonl and lm-eval's raw results to
--output-dir, prints one verdict line per task. Exit status: 0 done, 1 a verdict says
DIFFERENCE and --fail-on-difference was given, 2 bad input or a missing optional package
(nothing was evaluated).
"""

from __future__ import annotations

import argparse
import sys


def _tasks(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [t for v in values for t in v.split(",") if t]


def _limit(value: str) -> float | int:
    x = float(value)
    return int(x) if x >= 1 and x == int(x) else x


def _batch(value: str) -> int | str:
    return value if value.startswith("auto") else int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch eval`'s options to `parser`."""
    parser.description = __doc__.splitlines()[0]
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=True, help="local checkpoint folder or hub id")
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (needs the gguf package)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                   help="fused path: auto = Triton kernel on CUDA, PyTorch reference elsewhere; "
                        "triton on CPU needs TRITON_INTERPRET=1")
    g.add_argument("--no-strict", action="store_true", help="skip unpatchable MLPs instead of refusing the model")
    g = parser.add_argument_group("lm-eval tasks")
    g.add_argument("--tasks", nargs="+", default=None, help="lm-eval task, group or tag names (space or comma separated)")
    g.add_argument("--local-data", action="append", default=None, metavar="TASK=PATH",
                   help="read TASK (or every task of a group) from local files in the original schema "
                        "(MMLU-Pro JSONL, GPQA CSV); repeatable")
    g.add_argument("--limit", type=_limit, default=None, help="questions per task (or a fraction < 1)")
    g.add_argument("--batch-size", type=_batch, default=1, help="lm-eval batch size (int or auto)")
    g.add_argument("--num-fewshot", type=int, default=None, help="few-shot override (default: each task's own)")
    g.add_argument("--seed", type=int, default=0, help="seed for both runs (python, numpy, torch, few-shot)")
    g.add_argument("--gen-kwargs", default=None, help="generation overrides, e.g. max_gen_toks=256")
    g.add_argument("--apply-chat-template", action="store_true")
    g = parser.add_argument_group("token-level agreement")
    g.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text file")
    g.add_argument("--text-dataset", default=None, help="or a dataset: local .jsonl/.csv/.parquet/.txt or hub id")
    g.add_argument("--text-split", default="train")
    g.add_argument("--text-column", default="text")
    g.add_argument("--window", type=int, default=512, help="tokens per window")
    g.add_argument("--max-tokens", type=int, default=None, help="cap on tokens compared")
    g.add_argument("--text-batch-size", type=int, default=8, help="windows per forward pass")
    g.add_argument("--reference-dtype", default="auto", choices=["auto", "none", "float32", "float64"],
                   help="also run the unpatched model in this dtype and compare both with it "
                        "(auto: float32 for bf16/fp16 models, none for float32)")
    g = parser.add_argument_group("report")
    g.add_argument("--output-dir", default="swiglu_eval", help="report.json, report.md, samples/ go here")
    g.add_argument("--alpha", type=float, default=0.05, help="significance level of the paired tests")
    g.add_argument("--power", type=float, default=0.8, help="power for minimum detectable differences")
    g.add_argument("--top1-min", type=float, default=0.999, help="token verdict without reference: least top-1 agreement")
    g.add_argument("--kl-max", type=float, default=1e-4, help="token verdict without reference: largest mean KL, nats/token")
    g.add_argument("--ratio-max", type=float, default=2.0,
                   help="token verdict with reference: largest KL(ref||fused) / KL(ref||eager)")
    g.add_argument("--fail-on-difference", action="store_true", help="exit 1 if any verdict is DIFFERENCE")


def main(args: argparse.Namespace) -> int:
    """Run `swiglu-patch eval` with parsed `args`; returns the exit status."""
    from swiglu_patch import PatchError

    from .errors import EvalSetupError
    from .runner import run_eval

    try:
        report = run_eval(
            args.model, tasks=_tasks(args.tasks), output_dir=args.output_dir, dtype=args.dtype, device=args.device,
            gguf_file=args.gguf_file, limit=args.limit, batch_size=args.batch_size, num_fewshot=args.num_fewshot,
            seed=args.seed, gen_kwargs=args.gen_kwargs, local_data=args.local_data,
            apply_chat_template=args.apply_chat_template, text=args.text, text_dataset=args.text_dataset,
            text_split=args.text_split, text_column=args.text_column, window=args.window, max_tokens=args.max_tokens,
            text_batch_size=args.text_batch_size, reference_dtype=args.reference_dtype, backend=args.backend, strict=not args.no_strict,
            alpha=args.alpha, power=args.power, top1_min=args.top1_min, kl_max=args.kl_max,
            ratio_max=args.ratio_max,
        )
    except (EvalSetupError, PatchError, ImportError) as err:
        print(f"swiglu-patch eval: error: {err}", file=sys.stderr)
        return 2
    labels = [r["verdict"]["label"] for r in report["rows"]]
    if report.get("tokens"):
        labels.append(report["tokens"]["verdict"]["label"])
    return 1 if args.fail_on_difference and "DIFFERENCE" in labels else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.cli")
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
