"""The experts' routing prep alone (`kernels/experts_routing.py`): its chunk sizes against the one it chooses.

    python -m benchmarks.bench_routing --out OUT [--shapes qwen3-30b-a3b ...] [--tokens 128 768 4096]
    python -m benchmarks.bench_routing --dry-run --out /tmp/routing   # CPU, Triton interpreter, no timing
    python -m benchmarks.bench_routing --render OUT/results.json      # markdown only

Per row (a real model's experts and top_k from `bench_moe.MOE_SHAPES`, T tokens, uniform routing as
`bench_moe.routing` draws it, BLOCK_M the planner's for that call): the prep as `expert_blocks` runs
it ("chosen": the one-program kernel up to `KERNEL_PAIRS` pairs, else `expert_blocks_chunked` at
`chunk_pairs`), `expert_blocks_chunked` at each --chunks size, and the one-program kernel where the
pairs are at most --one-program-max. Every way's (sorted_pairs, block_expert) is checked equal,
element for element, to `expert_blocks_torch`'s before it is timed; a way that differs fails the run.

Timing: `harness.timing.GraphTimer` (CUDA-graph replays, L2 flushed before every timed call, the ways
of a row interleaved). Writes OUT/results.json (GPU, versions, commit) after every row and OUT/results.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .bench_moe import MOE_SHAPES, TINY, routing
from .harness.cli import Parser, guarded, render_or_run, require_device, write_json

PROG = "python -m benchmarks.bench_routing"
SCHEMA = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in MOE_SHAPES],
                   default=["qwen3-30b-a3b", "qwen3.5-35b-a3b", "olmoe-1b-7b", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[64, 128, 256, 768, 1536, 4096, 16384])
    p.add_argument("--chunks", nargs="+", type=positive_int, default=[64, 128, 256, 512, 1024, 2048],
                   help="pairs per chunk of the chunked kernels (powers of 2)")
    p.add_argument("--one-program-max", type=positive_int, default=2048,
                   help="the most pairs the one-program kernel is timed at")
    p.add_argument("--rep-ms", type=float, default=10.0, help="GPU ms of timed calls per way and row")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU: a tiny shape, Triton interpreter, no timing")
    p.add_argument("--render", type=Path, help="rebuild results.md from this results.json and exit")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render a results.json)")
    bad = [c for c in args.chunks if c & (c - 1)]
    if bad:
        p.error(f"--chunks must be powers of 2, got {bad}")
    return args


def ways(top_k_index: torch.Tensor, num_experts: int, block_m: int, chunks: list[int],
         one_program_max: int) -> dict:
    """{way: zero-argument callable returning (sorted_pairs, block_expert)} for one routing."""
    from swiglu_patch.kernels import experts_routing as routing_prep

    pairs = top_k_index.numel()
    fns = {"chosen": lambda: routing_prep.expert_blocks(top_k_index, num_experts, block_m)}
    if pairs <= one_program_max:
        fns["one program"] = lambda: routing_prep.expert_blocks_one_program(top_k_index, num_experts, block_m)
    for chunk in chunks:
        fns[f"chunks of {chunk}"] = (lambda c: lambda: routing_prep.expert_blocks_chunked(
            top_k_index, num_experts, block_m, chunk=c))(chunk)
    return fns


def run(args: argparse.Namespace) -> dict:
    from swiglu_patch.kernels import dispatch
    from swiglu_patch.kernels.experts_routing import chunk_pairs, expert_blocks_torch

    from .harness.timing import GraphTimer

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    gpu = "cpu" if dry else torch.cuda.get_device_name()
    shapes = [TINY] if dry else [s for s in MOE_SHAPES if s.name in args.shapes]
    tokens_list = [5, 37] if dry else args.tokens
    chunks = [128] if dry else args.chunks
    timer = None if dry else GraphTimer(rep_ms=args.rep_ms, rounds=3)
    rows = []
    for shape in shapes:
        for tokens in tokens_list:
            idx, _ = routing(shape, tokens, "uniform", device, args.seed)
            dtype = torch.float32 if dry else torch.bfloat16  # the interpreter refuses bf16 calls
            _, _, config = dispatch.choose(gpu, dtype, tokens, shape.k, shape.i, op="experts",
                                           experts=(shape.experts, shape.top_k), transposed=shape.gpt_oss)
            fns = ways(idx, shape.experts, config.block_m, chunks, args.one_program_max)
            ref = expert_blocks_torch(idx, shape.experts, config.block_m)
            for name, fn in fns.items():
                got = fn()
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (
                    f"{shape.name} T={tokens}: {name} lays the pairs out otherwise than expert_blocks_torch")
            row = {"shape": shape.name, "tokens": tokens, "pairs": idx.numel(), "experts": shape.experts,
                   "block_m": config.block_m, "chosen_chunk": chunk_pairs(idx.numel()), "us": {}}
            if not dry:
                row["us"] = {k: v * 1e6 for k, v in timer.many(fns).items()}
            rows.append(row)
            # after every row: a run cut by a time limit keeps what it measured
            write_json(result(args, device, timer, chunks, rows), args.out / "results.json")
            print(f"{shape.name} T={tokens} pairs={row['pairs']}: "
                  + " ".join(f"{k}={v:.1f}" for k, v in row["us"].items()), flush=True)
    return result(args, device, timer, chunks, rows)


def result(args: argparse.Namespace, device: str, timer, chunks: list[int], rows: list[dict]) -> dict:
    """The results JSON's object for the rows measured so far."""
    return {"kind": "routing", "schema": SCHEMA, "environment": environment(device, args.commit),
            "timer": None if timer is None else timer.describe(), "chunks": chunks, "rows": rows}


def render_markdown(data: dict) -> str:
    from swiglu_patch.kernels.experts_routing import KERNEL_PAIRS

    env = data["environment"]
    gpu, versions = env.get("gpu") or {}, env.get("versions") or {}
    names = ["chosen", "one program"] + [f"chunks of {c}" for c in data["chunks"]]
    lines = ["# The experts' routing prep", "",
             f"GPU: {gpu.get('name')}; torch {versions.get('torch')}, triton {versions.get('triton')}; commit "
             f"{(env.get('git') or {}).get('commit')}.", f"Timer: {data.get('timer')}.", "",
             "Microseconds per call (median); every way's layout equal to `expert_blocks_torch`'s. chosen: "
             f"`expert_blocks` (one program to {KERNEL_PAIRS} pairs, else chunks of `chunk_pairs`, in brackets).", "",
             "| shape | T | pairs | BLOCK_M | " + " | ".join(names) + " | chosen / best |",
             "|---|---:|---:|---:|" + "---:|" * len(names) + "---:|"]
    for r in data["rows"]:
        us = r["us"]
        cells = [f"{us[n]:.1f}" if n in us else "-" for n in names]
        if us:
            cells[0] += "" if r["pairs"] <= KERNEL_PAIRS else f" ({r['chosen_chunk']})"
        best = min((v for k, v in us.items() if k != "chosen"), default=None)
        ratio = f"{us['chosen'] / best:.2f}" if best else "-"
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['pairs']} | {r['block_m']} | " + " | ".join(cells)
                     + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.render:
        require_device(PROG, args.dry_run)
    return render_or_run(args, "routing", SCHEMA, run, render_markdown)


if __name__ == "__main__":
    sys.exit(guarded(PROG, main, sys.argv[1:]))
