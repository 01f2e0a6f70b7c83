"""Host time per call, and eager-against-patched timings taken in turns.

Host time from idle: the device is synchronized, then one call is timed on the wall clock
from entry to return. The call only launches its kernels, so what is timed is the Python,
dispatcher and driver work a host-bound decode step pays per call, never GPU time: a full
launch queue cannot make the launch wait, because the queue is empty when the call starts.

Turns: host speed on a shared machine drifts by tens of percent between minutes, so every
comparison here runs its contenders in turns, round by round, the order reversed every other
round (A B, B A, A B, ...), and reports per-round ratios: a drift touches both sides of a ratio.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

Fn = Callable[[], object]


def synchronizer(device) -> Callable[[], None]:
    """A function that waits for `device` (a no-op on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _order(keys: list[str], round_: int) -> list[str]:
    return keys if round_ % 2 == 0 else keys[::-1]


def host_from_idle(fns: dict[str, Fn], calls: int, rounds: int, sync: Callable[[], None],
                   warmup: int = 10) -> dict[str, list[float]]:
    """Seconds of host time of single calls started on an idle device, the callables in turns.

    Args:
        fns: {name: zero-argument callable}.
        calls: timed calls per callable in all, split over `rounds`.
        rounds: rounds the callables take turns in.
        sync: waits for the device (`synchronizer`).
        warmup: untimed calls of each callable first (compilation, caches).

    Returns:
        {name: [seconds per call]}.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    per_round = max(1, math.ceil(calls / rounds))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in _order(list(fns), r):
            fn = fns[name]
            for _ in range(per_round):
                sync()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    sync()
    return samples


def in_turns(fns: dict[str, Fn], rounds: int, sync: Callable[[], None]) -> dict[str, list[float]]:
    """Wall seconds of one synchronized call of each callable per round, in turns (no warm-up:
    the caller warms up, since a first call may compile for seconds).

    Returns:
        {name: [seconds, one per round]}.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in _order(list(fns), r):
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def us_stats(seconds: list[float]) -> dict:
    """{"median_us", "p10_us", "p90_us", "calls"} of samples in seconds."""
    us = sorted(s * 1e6 for s in seconds)
    pick = lambda q: us[min(len(us) - 1, int(q * (len(us) - 1) + 0.5))]  # noqa: E731
    return {"median_us": statistics.median(us), "p10_us": pick(0.1), "p90_us": pick(0.9), "calls": len(us)}


def ratio_stats(numerator: list[float], denominator: list[float]) -> dict:
    """Per-round ratios numerator[r] / denominator[r]: {"median", "min", "max", "rounds": [...]}.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"ratio_stats: need equal, non-empty lists of rounds, got {len(numerator)} and "
                         f"{len(denominator)}")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}
