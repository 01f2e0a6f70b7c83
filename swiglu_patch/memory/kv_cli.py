"""`swiglu-patch kv-capacity`: the options, the tables and the files.

Defining the options imports nothing heavy (``--help`` stays fast); the computation is pure
arithmetic on the configs (no GPU, no weights).
"""

from __future__ import annotations

import argparse
import sys

from swiglu_patch.inputs import fraction, int_list, nonnegative_float, one_line, positive_float, positive_int
from swiglu_patch.memory.configs import list_presets, resolve_model
from swiglu_patch.memory.gpus import GPU_MEMORY_GIB, gpu_memory_gib
from swiglu_patch.memory.kv_capacity import (
    ASSUMPTIONS,
    KV_DTYPE_BYTES,
    CapacityResult,
    InsufficientMemoryError,
    kv_capacity,
    smallest_tp,
)
from swiglu_patch.memory.tables import fmt_bytes, fmt_int, markdown_table, writable_dir, write_json, write_text
from swiglu_patch.memory.weights import WEIGHT_DTYPE_BYTES

DESCRIPTION = """\
How many more KV-cache tokens fit on a GPU when the MLP is fused: the memory the fused MLP
saves at the activation peak of one prefill chunk becomes KV cache. Pure arithmetic on the
model's config; every assumption is printed under the table.
"""

EPILOG = """\
examples:
  swiglu-patch kv-capacity --model llama-3.1-8b --gpu H100 --chunk 512
  swiglu-patch kv-capacity --model qwen3-32b ./my-model/config.json --gpu-mem-gib 94 --chunk 512,8192
  swiglu-patch kv-capacity --model all --gpu H100 --out-dir results --name kv_h100 --plot kv_h100.png

--model takes a preset name, a config.json, a checkpoint folder, or a hub id (owner/name).
--out-dir writes <name>.json and <name>.md; --plot a PNG (needs matplotlib).
"""


def _gpu(text: str) -> str:
    try:
        gpu_memory_gib(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _tp(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 1, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch kv-capacity`'s options to `parser`."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", nargs="+", required=True, metavar="MODEL",
                        help=f"preset, config.json, checkpoint folder or hub id; 'all' = every preset "
                             f"({', '.join(list_presets())})")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", type=_gpu, default="H100", help=f"GPU name ({', '.join(GPU_MEMORY_GIB)}); default H100")
    gpu.add_argument("--gpu-mem-gib", type=positive_float, metavar="GIB", help="memory of one GPU in GiB (instead of --gpu)")
    parser.add_argument("--tp", type=_tp, default="auto", help="tensor-parallel degree, or auto: the smallest that fits")
    parser.add_argument("--weight-dtype", default="bf16", choices=sorted(WEIGHT_DTYPE_BYTES), help="default bf16")
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPE_BYTES), help="default bf16")
    parser.add_argument("--chunk", "--max-batched-tokens", dest="chunks", type=int_list, default=[512], metavar="TOKENS",
                        help="prefill chunk size(s), comma-separated (default 512)")
    parser.add_argument("--mem-fraction", type=fraction, default=0.9,
                        help="share of GPU memory the server may use (vLLM's gpu_memory_utilization; default 0.9)")
    parser.add_argument("--seq-len", type=positive_int, default=8192,
                        help="sequence length for the concurrent-sequence count (default 8192)")
    parser.add_argument("--overhead-gib", type=nonnegative_float, default=0.0, metavar="GIB",
                        help="memory for CUDA graphs, NCCL, fragmentation (default 0)")
    parser.add_argument("--runtime", default="server", choices=["server", "hf"],
                        help="server: fused attention, RMSNorm and RoPE kernels (default); "
                             "hf: HF's own norms and RoPE with fused attention")
    parser.add_argument("--family", help="treat an unknown model_type as this family (e.g. llama)")
    parser.add_argument("--out-dir", metavar="DIR", help="write <name>.json and <name>.md here")
    parser.add_argument("--name", default="kv_capacity", help="file stem for --out-dir (default kv_capacity)")
    parser.add_argument("--plot", metavar="PNG", help="write a plot to this path (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    """Run `swiglu-patch kv-capacity` with parsed `args`; returns the exit status."""
    try:
        if args.plot:
            from swiglu_patch.memory.plotting import require_matplotlib

            require_matplotlib()
        if args.out_dir is not None:
            writable_dir(args.out_dir)
        results, skipped = _compute(args)
    except (ValueError, ImportError) as exc:
        return _fail(exc)
    if not results:
        return _fail("; ".join(f"{name}: {why}" for name, why in skipped))
    gpu = f"{args.gpu_mem_gib:g} GiB" if args.gpu_mem_gib is not None else f"{args.gpu} ({gpu_memory_gib(args.gpu):g} GiB)"
    header = (f"KV-cache capacity per GPU on {gpu}, fraction {args.mem_fraction:g}, weights {args.weight_dtype}, "
              f"KV {args.kv_dtype}, sequences of {args.seq_len} tokens, {args.runtime} runtime")
    table = detail_table(results[0]) if len(results) == 1 else summary_table(results)
    notes = "\n".join(f"- {a}" for a in ASSUMPTIONS)
    skipped_text = "".join(f"\n- skipped {name}: {why}" for name, why in skipped)
    print(f"{header}\n\n{table}\n\nAssumptions:\n{notes}{skipped_text}")
    if args.out_dir:
        from swiglu_patch.provenance import environment

        stem = f"{args.out_dir.rstrip('/')}/{args.name}"
        command = " ".join(["swiglu-patch"] + sys.argv[1:]) if sys.argv[0].endswith(("swiglu-patch", "cli.py")) else None
        try:
            write_json(f"{stem}.json", {"command": command, "settings": _settings(args),
                                        "environment": environment("cpu"), "results": [r.to_dict() for r in results],
                                        "skipped": [{"model": n, "reason": w} for n, w in skipped]})
            write_text(f"{stem}.md", f"{header}\n\n{summary_table(results)}\n\nAssumptions:\n{notes}{skipped_text}\n")
        except OSError as exc:
            return _fail(f"cannot write {stem}.json / .md ({exc.strerror or exc}); check --out-dir and --name")
        print(f"\nwrote {stem}.json, {stem}.md")
    if args.plot:
        from swiglu_patch.memory.plotting import plot_kv_extra

        path = plot_kv_extra([r.to_dict() for r in results], args.plot, title=header)
        print(f"wrote {path}")
    return 0


def _fail(message: object) -> int:
    print(f"swiglu-patch kv-capacity: error: {one_line(message)}", file=sys.stderr)
    return 2


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}


def _compute(args: argparse.Namespace) -> tuple[list[CapacityResult], list[tuple[str, str]]]:
    specs = list_presets() if args.model == ["all"] else args.model
    gib = args.gpu_mem_gib if args.gpu_mem_gib is not None else gpu_memory_gib(args.gpu)
    results, skipped = [], []
    for spec in specs:
        shape = resolve_model(spec).shape(args.family)
        kw = dict(gpu_mem_gib=gib, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                  mem_fraction=args.mem_fraction, seq_len=args.seq_len, overhead_gib=args.overhead_gib,
                  runtime=args.runtime)
        try:  # one tp per model: the smallest that fits the largest chunk asked for
            tp = smallest_tp(shape, chunk_tokens=max(args.chunks), **kw) if args.tp == "auto" else args.tp
            for chunk in args.chunks:
                results.append(kv_capacity(shape, tp=tp, chunk_tokens=chunk, **kw))
        except InsufficientMemoryError as exc:
            if len(specs) == 1:
                raise
            skipped.append((spec, str(exc)))
    return results, skipped


def detail_table(r: CapacityResult) -> str:
    """One model, one chunk: quantity | eager | fused | fused - eager."""
    capped = r.num_sliding_layers and r.sliding_window
    rows = [
        ["model (source)", f"{r.model} ({r.source})", "", ""],
        ["tensor parallel / chunk", f"tp={r.tp}, chunk {r.chunk_tokens} tokens", "", ""],
        ["usable memory per GPU", fmt_bytes(r.usable_bytes), "", ""],
        ["weights per GPU", fmt_bytes(r.weights_per_gpu), "", ""],
        ["peak activation per chunk", fmt_bytes(r.act_eager), fmt_bytes(r.act_fused), fmt_bytes(r.act_fused - r.act_eager)],
        ["  reached at", r.act_eager_where, r.act_fused_where, ""],
        ["KV budget", fmt_bytes(r.budget_eager), fmt_bytes(r.budget_fused), fmt_bytes(r.budget_fused - r.budget_eager)],
        ["KV bytes per token (all layers)", fmt_int(r.kv_per_token_full), "", ""],
        ["KV tokens (full count)", fmt_int(r.tokens_eager_full), fmt_int(r.tokens_fused_full),
         f"+{fmt_int(r.extra_tokens_full)} ({r.extra_pct:.2f}%)"],
    ]
    if capped:
        rows.append([f"KV tokens (window {r.sliding_window} capped, {r.seq_len}-token seqs)",
                     fmt_int(r.tokens_eager_capped), fmt_int(r.tokens_fused_capped), f"+{fmt_int(r.extra_tokens_capped)}"])
    rows.append([f"concurrent {r.seq_len}-token sequences" + (" (capped)" if capped else ""),
                 fmt_int(r.seqs_eager), fmt_int(r.seqs_fused), f"+{fmt_int(r.extra_seqs)}"])
    return markdown_table(["quantity", "eager MLP", "fused MLP", "fused - eager"], rows)


def summary_table(results: list[CapacityResult]) -> str:
    """One row per (model, chunk)."""
    rows = []
    for r in results:
        rows.append([
            r.model, r.tp, r.chunk_tokens, fmt_bytes(r.weights_per_gpu), fmt_bytes(r.act_eager), fmt_bytes(r.act_fused),
            fmt_int(r.kv_per_token_full), fmt_int(r.tokens_eager_full), fmt_int(r.tokens_fused_full),
            f"+{fmt_int(r.extra_tokens_full)}", f"{r.extra_pct:.2f}%",
            f"+{fmt_int(r.extra_tokens_capped)}" if r.num_sliding_layers else "same",
            f"{r.seqs_eager} -> {r.seqs_fused}",
        ])
    headers = ["model", "tp", "chunk", "weights/GPU", "act eager", "act fused", "KV B/token", "KV tokens eager",
               "KV tokens fused", "extra tokens", "extra %", "extra (window-capped)", f"seqs of {results[0].seq_len}"]
    return markdown_table(headers, rows)
