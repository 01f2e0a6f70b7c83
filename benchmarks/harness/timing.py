"""Timers: the median seconds per call of zero-argument callables.

GPU, `GraphTimer` (the default): each callable is captured once in a CUDA graph, then every
timed call is one graph replay bracketed by CUDA events, right after an L2 flush that *reads*
a 256 MB buffer. So:

- the time is GPU time: a replay costs the host a few µs whatever the callable does in
  Python, so host overhead never leaks into the number (with `do_bench`, a call whose host
  time exceeds the flush shows that excess as GPU time; ours at ~100 µs of host time did);
- L2 holds none of the inputs when the call starts, and what it holds is *clean*: a real
  forward pass reaches a layer's MLP after reading other weights and the KV cache, not after
  writing 256 MB. `do_bench` flushes by zeroing its buffer, which leaves up to 50 MB of dirty
  lines in L2 that the timed kernel pays to write back to HBM: at decode, where a 7-9B
  model's gate/up weight is 200-270 MB, that is 20% more DRAM traffic than the kernel itself
  causes (a study measured the difference: `docs/history.md`);
- the ways of one row are timed interleaved, in `rounds` rounds, so a clock or thermal drift
  during the row touches all of them alike; the median of all samples is reported.

A callable that synchronizes with the host (found by running its warm-up calls under
`torch.cuda.set_sync_debug_mode("error")`, before any capture is tried) or that fails to
capture is timed the same way without a graph, and `GraphTimer.modes` says which. (A capture
that fails can leave the default CUDA generator in capture mode, so later `torch.randn` on
the GPU raises; the sync check keeps the usual case from getting there.) `DoBenchTimer` is the previous method
(`triton.testing.do_bench`, zeroing flush, one way after the other), kept for comparison.

GPU, `EventTimer` (training steps, `bench_train`): CUDA events around eager calls, no graph and
no flush, the ways interleaved in rounds. A forward + backward step allocates its gradients
and reads megabytes per call, so a graph (which would pin its allocations) and an L2 flush
(small beside it) are left out.

CPU (--dry-run only): perf_counter around each call, a fixed number of calls.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

Fn = Callable[[], object]
FLUSHES = ("read", "zero", "none")  # GraphTimer's L2 states before a timed call


class GraphTimer:
    """Median GPU seconds per call: CUDA-graph replays after a read-only L2 flush, ways interleaved.

    Args:
        warmup_ms: GPU time spent on untimed calls of each callable before timing.
        rep_ms: GPU time of timed calls per callable (at least `min_reps` calls).
        rounds: the timed calls of each callable are split into this many rounds, and the
            callables of one `many` call take turns round by round.
        flush_mib: size of the buffer read before every timed call (L2 is 50 MB on H100).
        flush: "read" (the default: L2 left clean) or "zero" (do_bench's way: L2 left dirty),
            for comparing the two L2 states; or "none": the replays back to back with nothing
            between them, as a training loop runs its GEMMs. Long enough (hundreds of ms per way)
            that holds a GPU at its power cap, where the speed of a kernel follows the energy it
            spends (an H100 SXM at 700 W runs its SMs at ~1350 of 1980 MHz), and the flush's
            pause before every call would let the chip rest.
    """

    def __init__(self, warmup_ms: float = 10.0, rep_ms: float = 40.0, rounds: int = 4,
                 flush_mib: int = 256, min_reps: int = 8, max_reps: int = 2000, flush: str = "read"):
        import torch

        if flush not in FLUSHES:
            raise ValueError(f"GraphTimer: flush must be one of {', '.join(FLUSHES)}, got {flush!r}")

        self.torch = torch
        self.warmup_ms, self.rep_ms, self.rounds = warmup_ms, rep_ms, max(1, rounds)
        self.min_reps, self.max_reps = min_reps, max_reps
        if flush != "none":
            self._flush_buf = torch.ones(flush_mib << 18, dtype=torch.float32, device="cuda")  # read-only: any values
            self._flush_out = torch.empty((), dtype=torch.float32, device="cuda")
        self.flush = flush
        self.modes: dict[str, str] = {}  # key -> "graph" or "eager (reason)", of the last `many`

    def describe(self) -> str:
        if self.flush == "none":
            l2 = "no L2 flush, replays back to back (sustained: at a GPU's power cap if long enough)"
        else:
            how = "reading" if self.flush == "read" else "zeroing"
            l2 = f"L2 flushed by {how} {self._flush_buf.numel() * 4 >> 20} MB before every timed call"
        return (f"CUDA-graph replay per call, {l2}, ways of a row interleaved in {self.rounds} rounds, "
                f"warmup {self.warmup_ms:g} ms, {self.rep_ms:g} ms of timed calls per way, median")

    def _flush(self) -> None:
        if self.flush == "read":
            self.torch.sum(self._flush_buf, dim=0, out=self._flush_out)
        elif self.flush == "zero":
            self._flush_buf.zero_()

    def _graph_of(self, fn: Fn):
        """(graph, fn's output in it, None), or (None, None, why) if fn syncs the host or fails
        to capture. fn is first run twice on a side stream (compile, autotune), as
        torch.cuda.graphs asks, with host syncs turned into errors."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):
                torch.cuda.set_sync_debug_mode("error")
                for _ in range(2):
                    fn()
        except RuntimeError as e:  # a host sync: a graph cannot hold it
            torch.cuda.synchronize()
            return None, None, f"host sync: {str(e)[:120]}"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = fn()
        except Exception as e:  # noqa: BLE001  (an uncapturable way is still timed, without a graph)
            torch.cuda.synchronize()
            return None, None, f"{type(e).__name__}: {str(e)[:120]}"
        torch.cuda.synchronize()
        return graph, out, None

    def _capture(self, fn: Fn):
        """(replay callable, mode): a CUDA graph of one call of fn, or fn itself if it syncs or
        fails to capture."""
        graph, _, why = self._graph_of(fn)
        return (graph.replay, "graph") if graph is not None else (fn, f"eager ({why})")

    def replayed_output(self, fn: Fn):
        """fn's output as one replay of a CUDA graph of one call computes it (the path `many`
        times: kernels can choose differently while a graph is captured), the output set to NaN
        before the replay so an element the replay does not write shows; None if fn cannot be
        captured (`many` then times it eagerly, and its eager output is the one to check)."""
        graph, out, _ = self._graph_of(fn)
        if graph is None:
            return None
        out.fill_(float("nan"))
        graph.replay()
        self.torch.cuda.synchronize()
        return out

    def _timed(self, replay: Fn, n: int) -> list[float]:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            self._flush()
            s.record()
            replay()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def many(self, fns: dict[str, Fn]) -> dict[str, float]:
        """{key: median seconds per call} of every callable, timed interleaved."""
        replays, self.modes, per_round, samples = {}, {}, {}, {}
        for key, fn in fns.items():
            replays[key], self.modes[key] = self._capture(fn)
            est_ms = statistics.median(self._timed(replays[key], 3))
            n_warm = min(self.max_reps, math.ceil(self.warmup_ms / max(est_ms, 1e-3)))
            self._timed(replays[key], max(1, n_warm))
            n = min(self.max_reps, max(self.min_reps, math.ceil(self.rep_ms / max(est_ms, 1e-3))))
            per_round[key], samples[key] = max(1, math.ceil(n / self.rounds)), []
        for _ in range(self.rounds):
            for key in fns:
                samples[key] += self._timed(replays[key], per_round[key])
        del replays  # the graphs and the memory their outputs hold
        return {key: statistics.median(v) / 1e3 for key, v in samples.items()}

    def __call__(self, fn: Fn) -> float:
        return self.many({"fn": fn})["fn"]


class DoBenchTimer:
    """`triton.testing.do_bench(fn, warmup, rep)`, median: the zeroing flush, no graph, one way at a time."""

    def __init__(self, warmup_ms: float = 10.0, rep_ms: float = 40.0):
        from triton.testing import do_bench

        self._do_bench, self.warmup_ms, self.rep_ms = do_bench, warmup_ms, rep_ms
        self.modes: dict[str, str] = {}

    def describe(self) -> str:
        return (f"triton.testing.do_bench(warmup={self.warmup_ms:g} ms, rep={self.rep_ms:g} ms), median, "
                "L2 flushed (256 MB zeroed) before every timed call, no CUDA graph")

    def __call__(self, fn: Fn) -> float:
        return self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") / 1e3

    def many(self, fns: dict[str, Fn]) -> dict[str, float]:
        self.modes = {key: "eager" for key in fns}
        return {key: self(fn) for key, fn in fns.items()}


class EventTimer:
    """Median seconds per call of eager calls bracketed by CUDA events (perf_counter on CPU),
    `warmup` untimed calls each, then `rounds` rounds in which every callable runs `reps` times,
    in the given order in even rounds and reversed in odd ones.

    Args:
        cuda: time with CUDA events (else perf_counter).
        reps, rounds, warmup: calls per callable and round, rounds, untimed calls first.
    """

    def __init__(self, cuda: bool, reps: int = 10, rounds: int = 3, warmup: int = 3):
        self.cuda, self.reps, self.rounds, self.warmup = cuda, reps, max(1, rounds), warmup
        self.modes: dict[str, str] = {}

    def describe(self) -> str:
        how = "CUDA events around eager calls" if self.cuda else "CPU perf_counter (numbers mean nothing)"
        return (f"{how}, {self.warmup} warm-up calls, {self.reps} timed calls per way in each of "
                f"{self.rounds} rounds, ways interleaved (order reversed every other round), median; no graph, "
                "no L2 flush")

    def many(self, fns: dict[str, Fn]) -> dict[str, float]:
        """{key: median seconds per call} of every callable, timed interleaved."""
        import torch

        self.modes = {key: "eager" for key in fns}
        samples: dict[str, list[float]] = {key: [] for key in fns}
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        for r in range(self.rounds):
            # order reversed every other round: at a GPU's power cap a way's time depends on the way before it
            for key, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
                if self.cuda:
                    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              for _ in range(self.reps)]
                    for start, end in events:
                        start.record()
                        fn()
                        end.record()
                    torch.cuda.synchronize()
                    samples[key] += [s.elapsed_time(e) / 1e3 for s, e in events]
                else:
                    for _ in range(self.reps):
                        t0 = time.perf_counter()
                        fn()
                        samples[key].append(time.perf_counter() - t0)
        return {key: statistics.median(v) for key, v in samples.items()}


class CpuTimer:
    """For CPU tensors: one warm-up call, then the median of `reps` timed calls."""

    def __init__(self, reps: int = 5):
        self.reps = reps
        self.modes: dict[str, str] = {}

    def describe(self) -> str:
        return f"CPU perf_counter, median of {self.reps} calls after 1 warm-up (dry run: numbers mean nothing)"

    def __call__(self, fn: Fn) -> float:
        fn()
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def many(self, fns: dict[str, Fn]) -> dict[str, float]:
        self.modes = {key: "eager" for key in fns}
        return {key: self(fn) for key, fn in fns.items()}


TIMERS = ("graph", "do_bench")


def gpu_timer(kind: str, warmup_ms: float, rep_ms: float, rounds: int = 4):
    """The GPU timer named `kind` ("graph" or "do_bench").

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "graph":
        return GraphTimer(warmup_ms, rep_ms, rounds)
    if kind == "do_bench":
        return DoBenchTimer(warmup_ms, rep_ms)
    raise ValueError(f"gpu_timer: unknown timer {kind!r}; known: {', '.join(TIMERS)}")
