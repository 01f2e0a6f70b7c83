"""What the GPU's clock and power did while a benchmark timed: `nvidia-smi` sampled in the background.

A GPU running large GEMMs back to back can reach its board power limit (an H100 SXM's is 700 W)
and lower its SM clock to stay under it: its speed is then set by the energy each step spends,
not by the peak clock. `ClockSampler` records that, so a report can say whether its times were
measured at the power cap:

    with ClockSampler() as clock:
        timer.many(steps)
    clock.summary()  # {"sm_mhz_median", "sm_mhz_max", "power_w_median", "power_limit_w", "power_capped_share"}

`summary()` is None where nvidia-smi is absent (a CPU run) or gave no sample. The reasons field
is nvidia-smi's `clocks_event_reasons.active` bitmask; bit 0x4 is "SW power cap".
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
SW_POWER_CAP = 0x4


def parse_samples(text: str) -> list[dict]:
    """nvidia-smi's `--query-gpu=QUERY --format=csv,noheader,nounits` lines -> one dict per line
    that parses (sm_mhz, max_mhz, power_w, limit_w, reasons); other lines are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            samples.append({"sm_mhz": float(fields[0]), "max_mhz": float(fields[1]), "power_w": float(fields[2]),
                            "limit_w": float(fields[3]), "reasons": int(fields[4], 16)})
        except ValueError:
            continue
    return samples


def summarize(samples: list[dict]) -> dict | None:
    """Medians of the SM clock and board power, the limits, and the share of samples at the power cap."""
    if not samples:
        return None
    return {"samples": len(samples), "sm_mhz_median": statistics.median(s["sm_mhz"] for s in samples),
            "sm_mhz_max": samples[0]["max_mhz"], "power_w_median": statistics.median(s["power_w"] for s in samples),
            "power_limit_w": samples[0]["limit_w"],
            "power_capped_share": sum(bool(s["reasons"] & SW_POWER_CAP) for s in samples) / len(samples)}


def describe(summary: dict | None) -> str:
    """One line for a report, or "" without samples."""
    if not summary:
        return ""
    return (f"GPU while timed: SM clock {summary['sm_mhz_median']:.0f} MHz (median; {summary['sm_mhz_max']:.0f} max), "
            f"board power {summary['power_w_median']:.0f} W of its {summary['power_limit_w']:.0f} W limit, at the "
            f"power cap in {100 * summary['power_capped_share']:.0f}% of {summary['samples']} samples")


class ClockSampler:
    """Samples device `index` every `interval_ms` while the `with` block runs (see the module docstring)."""

    def __init__(self, index: int = 0, interval_ms: int = 100):
        self.index, self.interval_ms = index, interval_ms
        self._proc = self._out = None
        self.samples: list[dict] = []

    def __enter__(self) -> ClockSampler:
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            self._out = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                           "-lms", str(self.interval_ms), "-i", str(self.index)],
                                          stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._out.seek(0)
        self.samples = parse_samples(self._out.read())
        self._out.close()

    def summary(self) -> dict | None:
        return summarize(self.samples)
