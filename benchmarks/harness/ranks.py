"""What the benchmarks run under torchrun share (`bench_tp`, `bench_moe_parallel`): every rank
runs the same calls on its shard of one loaded model, timed with all ranks synchronized, the
modes ("eager": the unpatched model, "patched") in turns on that model.

Items: ("prefill", P) is one forward of a [1, P] prompt with use_cache=True and logits_to_keep=1;
("dynamic", B) and ("static", B) are greedy `generate` calls on [B, prompt] prompts with that
cache and exactly `new` new tokens. A row holds each mode's seconds per round, its median rate
(prefill: tokens/s, generate: B x new / s) and the per-round speedup t_eager / t_patched.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Callable

import torch

from .cli import render_or_run


def require_torchrun(parser: argparse.ArgumentParser, prog: str) -> None:
    """A one-line usage error unless torchrun started this process."""
    if "WORLD_SIZE" not in os.environ:
        parser.error(f"run under torchrun: torchrun --standalone --nproc-per-node N -m {prog.split()[-1]} ...")


def init_ranks(cuda: bool) -> tuple[int, int]:
    """This process's (rank, world size), its CUDA device set and the process group started
    (NCCL on CUDA, gloo on CPU) with a 30-minute timeout: rank 0 may save a large checkpoint
    while the others wait at a barrier."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return rank, dist.get_world_size()


class Timer:
    """Wall time of a call with every rank synchronized before and after it."""

    def __init__(self, cuda: bool):
        import torch.distributed as dist

        self.cuda, self.barrier = cuda, dist.barrier

    def __call__(self, fn) -> tuple[float, object]:
        if self.cuda:
            torch.cuda.synchronize()
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        self.barrier()
        return time.perf_counter() - t0, out


def gather(value) -> list:
    """`value` of every rank, in rank order (on every rank)."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def item_inputs(items: list[tuple[str, int]], vocab: int, prompt: int, gen: torch.Generator,
                device) -> dict[tuple[str, int], torch.Tensor]:
    """Random token ids per item: [1, P] for a prefill, [B, prompt] for a `generate` (the same on
    every rank when `gen` is seeded alike)."""
    return {it: torch.randint(2, vocab, (1, it[1]) if it[0] == "prefill" else (it[1], prompt), generator=gen).to(device)
            for it in items}


def item_call(model, item: tuple[str, int], ids: torch.Tensor, new: int) -> Callable[[], torch.Tensor]:
    """The zero-argument call that runs `item` on `model` (see the module docstring)."""
    if item[0] == "prefill":
        return lambda: model(ids, use_cache=True, logits_to_keep=1)
    extra = {"cache_implementation": "static"} if item[0] == "static" else {}
    return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, **extra)


def paired_row(item: tuple[str, int], eager_s: list[float], patched_s: list[float], new: int) -> dict:
    """An item's timed row from each mode's seconds per round (see the module docstring)."""
    kind, size = item
    work = size if kind == "prefill" else size * new
    ratios = [a / b for a, b in zip(eager_s, patched_s)]
    return {"kind": kind, "size": size, "eager_s": eager_s, "patched_s": patched_s,
            "eager_per_s": work / statistics.median(eager_s), "patched_per_s": work / statistics.median(patched_s),
            "speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}}


def rows_table(rows: list[dict], new_tokens: int, unpatched: str) -> list[str]:
    """The markdown table of `paired_row` rows (with `peak_extra_mib_per_rank` on prefill rows,
    `leading_tokens_equal` on generate rows, or `failed`); `unpatched` names the eager mode."""
    lines = [f"| part | size | {unpatched} /s | patched /s | speedup, median (min-max) | peak MiB above the model per "
             f"rank, {unpatched} / patched | leading greedy tokens equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = "tokens" if r["kind"] == "prefill" else "batch"
        if "failed" in r:
            lines.append(f"| {r['kind']} | {unit} {r['size']} | – | – | not run: {r['failed']} | – | – |")
            continue
        sp, peaks = r["speedup"], r.get("peak_extra_mib_per_rank")
        peak_cell = ", ".join(f"{p.get('eager', 0):.0f} / {p.get('patched', 0):.0f}" for p in peaks) if peaks else "–"
        lead = f"{r['leading_tokens_equal']} of {new_tokens}" if "leading_tokens_equal" in r else "–"
        lines.append(f"| {r['kind']} | {unit} {r['size']} | {r['eager_per_s']:.1f} | {r['patched_per_s']:.1f} | "
                     f"**{sp['median']:.3f}x** ({sp['min']:.3f}-{sp['max']:.3f}) | {peak_cell} | {lead} |")
    return lines


def finish(args: argparse.Namespace, kind: str, schema: int, run: Callable, render_markdown: Callable) -> int:
    """`cli.render_or_run`, then, under torchrun, a barrier (rank 0 has written) and the process group's end."""
    import torch.distributed as dist

    code = render_or_run(args, kind, schema, run, render_markdown)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code
