"""Tensor parallelism (transformers' `tp_plan="auto"`) end to end, eager against patched.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp --out OUT --commit C [--layers 32]
    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp --dry-run --out /tmp/tp   # CPU, gloo
    python -m benchmarks.bench_tp --render OUT/results.json

A random-init model with Llama-3-8B's dimensions (`harness/models.py`; `--layers`, default all
32) in bf16 is saved once by rank 0 (`--model-dir`, kept for a later run) and loaded by every
rank with ``tp_plan="auto"``: each rank holds its shard of every projection, NCCL between GPUs
(gloo on CPU for the dry run, fp32, the patch's torch backend). One loaded model is timed
eager and patched: `apply_fused_mlp` and `unpatch` (which restores the sharded weights bit for
bit) switch it, the two modes in turns, `--rounds` rounds, the order reversed every other round;
each item runs once per mode untimed first (a static cache compiles there).

- prefill: one forward of [1, P] tokens (use_cache, logits_to_keep=1: what `generate` runs for a
  prompt), P in `--prefill`; tokens/s, and the peak memory it allocates above the model, per rank.
- generate: greedy, `--new-tokens` forced, [B, `--prompt`] prompts, B in `--batches`, with the
  dynamic cache and `cache_implementation="static"`; a cache kind that fails under TP is
  recorded with its error and not timed.
- agreement: patched against eager logits on a 512-token prompt (relative error), and the
  leading greedy tokens the two modes share.

Rank 0 writes OUT/results.json (GPU, versions, commit) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .harness.cli import Parser, guarded
from .harness.models import MODELS, TINY, build_model
from .harness.ranks import (Timer, finish, gather, init_ranks, item_call, item_inputs, paired_row, require_torchrun,
                            rows_table)

PROG = "python -m benchmarks.bench_tp"
SCHEMA = 1
MODES = ("eager", "patched")
CACHES = ("dynamic", "static")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--layers", type=positive_int, help="decoder layers (default 32; the dry run 2)")
    p.add_argument("--model-dir", type=Path, help="where rank 0 saves the random-init checkpoint (default /tmp/...)")
    p.add_argument("--prefill", type=positive_int, nargs="+", help="prompt lengths (default 4096 8192)")
    p.add_argument("--batches", type=positive_int, nargs="+", help="generate batch sizes (default 1 32)")
    p.add_argument("--cache", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--prompt", type=positive_int, help="generate prompt length (default 128)")
    p.add_argument("--new-tokens", type=positive_int, help="tokens generated per call (default 64)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, gloo, fp32, backend torch")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if args.render:
        return args
    if args.out is None:
        p.error("--out is required (or --render RESULTS_JSON)")
    require_torchrun(p, PROG)
    small = args.dry_run
    args.layers = args.layers or (2 if small else 32)
    args.prefill = args.prefill or ([16, 32] if small else [4096, 8192])
    args.batches = args.batches or ([1, 2] if small else [1, 32])
    args.prompt = args.prompt or (8 if small else 128)
    args.new_tokens = args.new_tokens or (4 if small else 64)
    args.model_dir = args.model_dir or Path(f"/tmp/bench_tp_{'tiny' if small else 'llama-3-8b'}_{args.layers}l")
    return args


def _load(path: Path, dtype):
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig  # transformers 5.x; tp_plan= is deprecated there
    except ImportError:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                distributed_config=DistributedConfig(tp_plan="auto")).eval()


def _checkpoint(args, dims, dtype, rank: int) -> None:
    """Rank 0 saves the random-init model once; every rank waits for it."""
    import torch.distributed as dist

    done = args.model_dir / ".complete"
    if rank == 0 and not done.exists():
        model = build_model(dims, args.layers, "cpu" if args.dry_run else "cuda", dtype, args.seed)
        model.save_pretrained(args.model_dir, max_shard_size="4GB")
        del model
        done.touch()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    dist.barrier()


def run(args: argparse.Namespace) -> dict:
    from swiglu_patch import apply_fused_mlp, unpatch

    cuda = not args.dry_run
    rank, world = init_ranks(cuda)
    dims = (TINY if args.dry_run else MODELS)["llama-3-8b"]
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "auto" if cuda else "torch"
    t_start = time.perf_counter()
    _checkpoint(args, dims, dtype, rank)
    model = _load(args.model_dir, dtype)
    load_s = time.perf_counter() - t_start
    device = model.device
    timer = Timer(cuda)
    gen = torch.Generator().manual_seed(args.seed)  # the same on every rank: the same inputs
    items = [("prefill", p) for p in args.prefill] + [(c, b) for c in args.cache for b in args.batches]
    inputs = item_inputs(items, dims.vocab, args.prompt, gen, device)
    probe = torch.randint(2, dims.vocab, (1, 512 if cuda else 32), generator=gen).to(device)
    new = args.new_tokens

    def set_mode(mode: str) -> None:
        if mode == "patched":
            apply_fused_mlp(model, backend=backend)
        else:
            unpatch(model)

    failed: dict[str, str] = {}
    times = {it: {m: [] for m in MODES} for it in items}
    peaks: dict = {it: {} for it in items if it[0] == "prefill"}
    tokens: dict = {}
    logits = {}
    with torch.inference_mode():
        for r in range(-1, args.rounds):  # round -1: untimed (compiles), peaks, agreement
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                set_mode(mode)
                if r == -1:
                    logits[mode] = model(probe).logits.float()
                for item in items:
                    if item[0] in failed:
                        continue
                    if cuda and r == -1 and item[0] == "prefill":
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        seconds, out = timer(item_call(model, item, inputs[item], new))
                    except Exception as e:  # noqa: BLE001  (a cache kind TP cannot run: recorded, not timed)
                        failed[item[0]] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                        if rank == 0:
                            traceback.print_exc()
                        continue
                    if r == -1:
                        if item[0] == "prefill" and cuda:
                            peaks[item][mode] = (torch.cuda.max_memory_allocated() - base) / 2**20
                        elif item[0] != "prefill":
                            tokens[item, mode] = out[0, args.prompt:].tolist()
                    else:
                        times[item][mode].append(seconds)
                        if rank == 0:  # in the log too, should the run end before results.json
                            print(f"[bench_tp] round {r} {mode:7s} {item[0]} {item[1]}: {seconds:.4f} s", flush=True)
                    del out
            if rank == 0:
                print(f"[bench_tp] round {r} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        set_mode("eager")
    rows = []
    for item in items:
        kind, size = item
        if kind in failed:
            rows.append({"kind": kind, "size": size, "failed": failed[kind]})
            continue
        row = paired_row(item, times[item]["eager"], times[item]["patched"], new)
        if kind == "prefill":
            row["peak_extra_mib_per_rank"] = gather(peaks[item]) if cuda else None
        else:
            a, b = tokens[item, "eager"], tokens[item, "patched"]
            row["leading_tokens_equal"] = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        rows.append(row)
    diff = logits["patched"] - logits["eager"]
    data = {
        "schema": SCHEMA, "kind": "bench_tp", "env": environment(device, args.commit),
        "model": {"shape": dims.name, "label": dims.label, "layers": args.layers, "hidden": dims.hidden,
                  "intermediate": dims.intermediate, "vocab": dims.vocab, "dtype": str(dtype).removeprefix("torch."),
                  "load_s": round(load_s, 1)},
        "settings": {"ranks": world, "tp_plan": "auto", "backend": backend, "rounds": args.rounds,
                     "prompt": args.prompt, "new_tokens": new, "dry_run": args.dry_run,
                     "stat": "wall time, all ranks synchronized; eager and patched in turns on one loaded model, "
                             "order reversed every other round; per-round ratios"},
        "rows": rows,
        "agreement": {"probe_tokens": probe.shape[1],
                      "rel_logit_diff": (diff.norm() / logits["eager"].norm()).item(),
                      "top1_agree": (logits["patched"].argmax(-1) == logits["eager"].argmax(-1)).float().mean().item()},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    return data if rank == 0 else {}  # the process group ends in _main, after rank 0 has written


def render_markdown(data: dict) -> str:
    m, s, env = data["model"], data["settings"], data["env"]
    gpu = env.get("gpu") or {}
    v = env.get("versions", {})
    a = data["agreement"]
    lines = [f"# Tensor parallelism: {m['label']} shape, {m['layers']} layers, TP = {s['ranks']}, eager against "
             "patched", "",
             f"- {m['dtype']}, transformers `tp_plan=\"auto\"`; GPU: {gpu.get('name', 'none (dry run on CPU)')} x "
             f"{s['ranks']}; torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}",
             f"- commit {env['git']['commit']}; measured {env.get('date_utc')}; model load {m['load_s']} s",
             f"- {s['stat']}; {s['rounds']} rounds", ""] + rows_table(data["rows"], s["new_tokens"], "eager")
    lines += ["", "Rates: prefill tokens/s; generate tokens/s (batch x new tokens / wall time). Agreement: "
              f"logits on a {a['probe_tokens']}-token prompt, patched against eager, relative "
              f"{a['rel_logit_diff']:.2e}, top-1 agreement {a['top1_agree']:.4f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    return finish(parse_args(argv), "bench_tp", SCHEMA, run, render_markdown)

if __name__ == "__main__":
    sys.exit(main())
