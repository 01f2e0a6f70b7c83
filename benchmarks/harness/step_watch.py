"""`StepWatch`: what each mode's forwards cost the host, and what the allocator and the garbage
collector did, while a benchmark row runs, without a profiler (which slows the host it measures).

Per mode (the models of one row, keyed like `bench_e2e`'s modes), over every call of the row
(its untimed first call and the timed rounds):

- forwards: hooks on each model's top module time every forward from its first to its last
  Python line (host time, plus any wait for the GPU inside it), a decode step's (one token per
  sequence: `step_ms`) apart from a prompt's (`prompt_ms`), and the gap from a forward's end to
  the next decode step of the same model (`gap_ms`: `generate`'s loop between forwards, with its
  device synchronisation; a gap before a prompt's forward is between calls and left out);
- marked modules (the experts modules, say): the host time inside their forwards, summed over
  one decode step (`marked_ms`), the part of a step's host time that the patch changes;
- the caching allocator: `num_alloc_retries` (a cudaMalloc that failed, freed the cache and
  retried: a synchronisation and a slow call), `num_ooms`, and the largest reserved and
  allocated bytes seen after a forward (CUDA only);
- Python's garbage collector: collections per generation and their total time, from
  `gc.callbacks`, charged to the mode whose forward ran last.

Where hooks would change the measured thing (a forward compiled by torch.compile), pass
hooks=False: then only the allocator's and the collector's totals over the row are kept, under
"all". The device's free memory (`torch.cuda.mem_get_info`) is read at the row's start and end.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch


def _alloc_stats(cuda: bool) -> dict:
    if not cuda:
        return {}
    s = torch.cuda.memory_stats()
    return {"retries": s.get("num_alloc_retries", 0), "ooms": s.get("num_ooms", 0),
            "reserved": s.get("reserved_bytes.all.current", 0), "allocated": s.get("allocated_bytes.all.current", 0)}


def _free_gib(cuda: bool) -> float | None:
    return torch.cuda.mem_get_info()[0] / 2**30 if cuda else None


def _ms(samples: list[float]) -> dict:
    """{"median", "p90", "max"} of seconds, in ms (None without samples)."""
    if not samples:
        return {"median": None, "p90": None, "max": None}
    ms = sorted(s * 1e3 for s in samples)
    return {"median": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * (len(ms) - 1) + 0.5))],
            "max": ms[-1]}


class _Tally:
    """One mode's figures over a row."""

    def __init__(self):
        self.step_s: list[float] = []
        self.marked_s: list[float] = []  # per decode step
        self.prompt_s: list[float] = []
        self.gap_s: list[float] = []
        self.retries = self.ooms = 0
        self.peak_reserved = self.peak_allocated = 0
        self.gc_count = [0, 0, 0]
        self.gc_s = 0.0
        self.last_end: float | None = None

    def summary(self) -> dict:
        return {"steps": len(self.step_s), "step_ms": _ms(self.step_s), "gap_ms": _ms(self.gap_s),
                "marked_ms": _ms(self.marked_s),
                "prompts": len(self.prompt_s), "prompt_ms": _ms(self.prompt_s),
                "alloc_retries": self.retries, "ooms": self.ooms,
                "peak_reserved_gib": self.peak_reserved / 2**30, "peak_allocated_gib": self.peak_allocated / 2**30,
                "gc_collections": list(self.gc_count), "gc_ms": self.gc_s * 1e3}


class StepWatch:
    """A context manager watching `models` ({mode: module}) while a row runs; `summary()` after.

    Args:
        models: the row's models by mode.
        cuda: the models run on CUDA (allocator figures and free memory are read).
        hooks: time each forward with hooks on the top modules (False for a compiled forward).
        marked: model -> the modules whose forwards' host time is summed per decode step (with hooks).
    """

    def __init__(self, models: dict[str, torch.nn.Module], cuda: bool, hooks: bool = True,
                 marked: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None):
        self.models, self.cuda, self.hooks, self.marked = models, cuda, hooks, marked
        self.tallies = {mode: _Tally() for mode in (models if hooks else ["all"])}
        self.current = None if hooks else "all"
        self._handles: list = []
        self._gc_t0: float | None = None
        self._in_marked = 0.0  # host seconds inside marked forwards since the top forward began

    def _pre(self, mode: str):
        def pre(module, args, kwargs):
            tally = self.tallies[mode]
            self.current = mode
            self._t0 = now = time.perf_counter()
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._step = ids is not None and ids.shape[-1] == 1
            self._in_marked = 0.0
            if self._step and tally.last_end is not None:
                tally.gap_s.append(now - tally.last_end)
        return pre

    def _post(self, mode: str):
        def post(module, args, kwargs, output):
            tally = self.tallies[mode]
            tally.last_end = now = time.perf_counter()
            (tally.step_s if self._step else tally.prompt_s).append(now - self._t0)
            if self._step and self.marked is not None:
                tally.marked_s.append(self._in_marked)
            self._charge_allocator(tally)
        return post

    def _marked_pre(self, module, args) -> None:
        self._marked_t0 = time.perf_counter()

    def _marked_post(self, module, args, output) -> None:
        self._in_marked += time.perf_counter() - self._marked_t0

    def _charge_allocator(self, tally: _Tally) -> None:
        stats = _alloc_stats(self.cuda)
        if not stats:
            return
        tally.retries += stats["retries"] - self._alloc["retries"]
        tally.ooms += stats["ooms"] - self._alloc["ooms"]
        tally.peak_reserved = max(tally.peak_reserved, stats["reserved"])
        tally.peak_allocated = max(tally.peak_allocated, stats["allocated"])
        self._alloc = stats

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None and self.current is not None:
            tally = self.tallies[self.current]
            tally.gc_count[info["generation"]] += 1
            tally.gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def __enter__(self) -> StepWatch:
        self._alloc = _alloc_stats(self.cuda)
        self.free_start_gib = _free_gib(self.cuda)
        if self.hooks:
            for mode, model in self.models.items():
                self._handles.append(model.register_forward_pre_hook(self._pre(mode), with_kwargs=True))
                self._handles.append(model.register_forward_hook(self._post(mode), with_kwargs=True))
                for m in (self.marked(model) if self.marked is not None else []):
                    self._handles.append(m.register_forward_pre_hook(self._marked_pre))
                    self._handles.append(m.register_forward_hook(self._marked_post))
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if not self.hooks:
            self._charge_allocator(self.tallies["all"])
        self.free_end_gib = _free_gib(self.cuda)

    def summary(self) -> dict:
        """{mode (or "all"): figures, "free_gib": [at the start, at the end]} (see the module docstring)."""
        return {**{mode: t.summary() for mode, t in self.tallies.items()},
                "free_gib": [self.free_start_gib, self.free_end_gib]}
