"""Per-step wall times of an HF `generate` call, from a logits processor that only reads the clock.

`generate` calls its logits processors once per new token, right after the forward that made
the token's logits, so the times between consecutive calls are the decode steps (the first
call follows the prompt's forward). A step's time includes everything `generate` does around
its forward: the cache, the logits processing, the stopping check and any sync in them.

Pooled over the rounds, the median step is less sensitive than the call's wall time to the
device host's drift: a slow second moves the steps that fall in it, not the median of hundreds.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LogitsProcessor


class StepClock(LogitsProcessor):
    """Appends `time.perf_counter()` at every call and returns the scores unchanged."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores

    def steps_s(self) -> list[float]:
        """Seconds between consecutive calls (the decode steps), then forgets them."""
        steps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        self.stamps = []
        return steps


def step_stats(steps_s: list[float]) -> dict:
    """{"median_ms", "p10_ms", "p90_ms", "steps"} of pooled step times."""
    ordered = sorted(steps_s)
    n = len(ordered)
    return {"median_ms": statistics.median(ordered) * 1e3, "p10_ms": ordered[n // 10] * 1e3,
            "p90_ms": ordered[(9 * n) // 10] * 1e3, "steps": n}
