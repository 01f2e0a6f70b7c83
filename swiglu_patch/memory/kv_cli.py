"""`swiglu-patch kv-capacity`: KV-cache tokens the fused MLP buys on a GPU.

    swiglu-patch kv-capacity --model llama-3.1-8b --gpu H100 --chunk 512
    swiglu-patch kv-capacity --model all --gpu H100 --chunk 512 --out-dir benchmarks/results \\
        --name kv_capacity_h100_chunk512 --plot docs/img/kv_capacity_h100_chunk512.png

Pure arithmetic on the config (no GPU, no weights): prints a table, and with --out-dir writes
<name>.json and <name>.md; --plot writes a PNG.
"""

from __future__ import annotations

import argparse
import sys

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
from swiglu_patch.memory.tables import (
    environment,
    fmt_bytes,
    fmt_int,
    int_list,
    markdown_table,
    write_json,
    write_text,
)
from swiglu_patch.memory.weights import WEIGHT_DTYPE_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", nargs="+", required=True, metavar="MODEL",
                        help=f"preset, config.json, checkpoint folder or hub id; 'all' = every preset "
                             f"({', '.join(list_presets())})")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", default="H100", help=f"GPU name ({', '.join(GPU_MEMORY_GIB)}); default H100")
    gpu.add_argument("--gpu-mem-gib", type=float, help="memory of one GPU in GiB (overrides --gpu)")
    parser.add_argument("--tp", default="auto", help="tensor-parallel degree, or 'auto' (smallest that fits)")
    parser.add_argument("--weight-dtype", default="bf16", choices=sorted(WEIGHT_DTYPE_BYTES))
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPE_BYTES))
    parser.add_argument("--chunk", "--max-batched-tokens", dest="chunks", type=int_list, default=[512],
                        help="prefill chunk size(s), comma-separated (default 512)")
    parser.add_argument("--mem-fraction", type=float, default=0.9,
                        help="share of GPU memory the server may use (vLLM gpu_memory_utilization; default 0.9)")
    parser.add_argument("--seq-len", type=int, default=8192, help="sequence length for concurrency (default 8192)")
    parser.add_argument("--overhead-gib", type=float, default=0.0,
                        help="memory for CUDA graphs, NCCL, fragmentation (default 0)")
    parser.add_argument("--runtime", default="server", choices=["server", "hf"],
                        help="activation model: server kernels (fused attention, RMSNorm, RoPE; default) or "
                             "HF's own norms and RoPE with fused attention")
    parser.add_argument("--family", help="treat an unknown model_type as this family (e.g. llama)")
    parser.add_argument("--out-dir", help="write <name>.json and <name>.md here")
    parser.add_argument("--name", default="kv_capacity", help="file stem for --out-dir (default kv_capacity)")
    parser.add_argument("--plot", help="write a PNG plot to this path")


def main(args: argparse.Namespace) -> int:
    try:
        results, skipped = _compute(args)
    except (ValueError, ImportError) as exc:
        print(f"swiglu-patch kv-capacity: {exc}", file=sys.stderr)
        return 2
    if not results:
        for name, why in skipped:
            print(f"swiglu-patch kv-capacity: {name}: {why}", file=sys.stderr)
        return 2
    gpu = f"{args.gpu_mem_gib:g} GiB" if args.gpu_mem_gib else f"{args.gpu} ({gpu_memory_gib(args.gpu):g} GiB)"
    header = (f"KV-cache capacity per GPU on {gpu}, fraction {args.mem_fraction:g}, weights {args.weight_dtype}, "
              f"KV {args.kv_dtype}, sequences of {args.seq_len} tokens, {args.runtime} runtime")
    table = detail_table(results[0]) if len(results) == 1 else summary_table(results)
    notes = "\n".join(f"- {a}" for a in ASSUMPTIONS)
    skipped_text = "".join(f"\n- skipped {name}: {why}" for name, why in skipped)
    print(f"{header}\n\n{table}\n\nAssumptions:\n{notes}{skipped_text}")
    if args.out_dir:
        stem = f"{args.out_dir.rstrip('/')}/{args.name}"
        command = " ".join(["swiglu-patch"] + sys.argv[1:]) if sys.argv[0].endswith(("swiglu-patch", "cli.py")) else None
        write_json(f"{stem}.json", {"command": command, "settings": _settings(args), "environment": environment(),
                                    "results": [r.to_dict() for r in results],
                                    "skipped": [{"model": n, "reason": w} for n, w in skipped]})
        write_text(f"{stem}.md", f"{header}\n\n{summary_table(results)}\n\nAssumptions:\n{notes}{skipped_text}\n")
        print(f"\nwrote {stem}.json, {stem}.md")
    if args.plot:
        from swiglu_patch.memory.plotting import plot_kv_extra

        path = plot_kv_extra([r.to_dict() for r in results], args.plot, title=header)
        print(f"wrote {path}")
    return 0


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}


def _compute(args: argparse.Namespace) -> tuple[list[CapacityResult], list[tuple[str, str]]]:
    specs = list_presets() if args.model == ["all"] else args.model
    gib = args.gpu_mem_gib if args.gpu_mem_gib else gpu_memory_gib(args.gpu)
    results, skipped = [], []
    for spec in specs:
        shape = resolve_model(spec).shape(args.family)
        kw = dict(gpu_mem_gib=gib, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                  mem_fraction=args.mem_fraction, seq_len=args.seq_len, overhead_gib=args.overhead_gib,
                  runtime=args.runtime)
        try:  # one tp per model: the smallest that fits the largest chunk asked for
            tp = smallest_tp(shape, chunk_tokens=max(args.chunks), **kw) if args.tp == "auto" else _tp(args.tp)
            for chunk in args.chunks:
                results.append(kv_capacity(shape, tp=tp, chunk_tokens=chunk, **kw))
        except InsufficientMemoryError as exc:
            if len(specs) == 1:
                raise
            skipped.append((spec, str(exc)))
    return results, skipped


def _tp(text: str) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"--tp must be an integer or 'auto', got {text!r}") from exc


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
