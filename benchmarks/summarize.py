"""Geometric-mean ratios per regime from bench_mlp results: the numbers the README quotes.

    python -m benchmarks.summarize benchmarks/results/h100/mlp/results.json [--out summary.md]
    python -m benchmarks.summarize NEW.json ... --compare OLD.json ...   # run-to-run spread

Also fits, per dtype and way, the decode time at M = 1 over the shapes as
weight bytes / bandwidth + a fixed cost per call (least squares): how fast a way streams
weights, and what every call pays on top.

Regimes: decode (M <= 16), middle (32 <= M <= 256), prefill (M >= 512); Llama-3.2-1B apart:
its whole call (~28 µs at decode) is short enough that the fixed cost of any launch (start-up,
pipeline fill, the last wave) is a quarter of it, for every way alike.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from .harness.cli import Parser, UsageError, guarded, read_json

PROG = "python -m benchmarks.summarize"

OTHERS = ("hf_eager", "torch_compile", "liger")


def regime(m: int) -> str:
    return "decode M<=16" if m <= 16 else ("middle 32-256" if m <= 256 else "prefill M>=512")


def summarize(rows: list[dict]) -> list[dict]:
    acc: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        ways = r["ways"]
        if ways["ours"]["status"] != "ok" or ways["gemm_only"]["status"] != "ok":
            continue
        ours = ways["ours"]["us"]
        others = [ways[w]["us"] for w in OTHERS if ways.get(w, {}).get("status") == "ok"]
        group = "Llama-3.2-1B" if r["shape"] == "llama-3.2-1b" else "other 5 shapes"
        a = acc[(r["dtype"], regime(r["M"]), group)]
        a["gemm"].append(math.log(ours / ways["gemm_only"]["us"]))
        a["best"].append(math.log(ours / min(others)))
        a["floor"].append(r["floor_us"] / ours)
    out = []
    for (dtype, reg, group), a in sorted(acc.items()):
        out.append(dict(
            dtype=dtype, regime=reg, shapes=group, rows=len(a["gemm"]),
            ours_over_gemm_only=math.exp(sum(a["gemm"]) / len(a["gemm"])),
            ours_over_best_other=math.exp(sum(a["best"]) / len(a["best"])),
            floor_over_ours_mean=sum(a["floor"]) / len(a["floor"]),
        ))
    return out


def decode_fit(rows: list[dict], way: str, dtype: str) -> tuple[float, float] | None:
    """(TB/s, fixed µs) of time = weight bytes / bandwidth + fixed over the shapes at M = 1,
    by least squares; None with fewer than two shapes."""
    def weight_bytes(r: dict) -> float:  # min_bytes counts x, the weight and out; keep the weight's share
        elements = r["M"] * r["K"] + 2 * r["I"] * r["K"] + r["M"] * r["I"]
        return 2 * r["I"] * r["K"] * (r["min_bytes"] / elements)

    pts = [(weight_bytes(r), r["ways"][way]["us"]) for r in rows
           if r["dtype"] == dtype and r["M"] == 1 and r["ways"].get(way, {}).get("status") == "ok"]
    if len(pts) < 2:
        return None
    n, sx, sy = len(pts), sum(b for b, _ in pts), sum(t for _, t in pts)
    sxx, sxy = sum(b * b for b, _ in pts), sum(b * t for b, t in pts)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)  # µs per byte
    return (1e-6 / slope if slope > 0 else float("inf")), (sy - slope * sx) / n  # µs/byte -> TB/s


def run_to_run(new: list[dict], old: list[dict], way: str, m_min: int = 512,
               m_max: int | None = None) -> tuple[float, float, float] | None:
    """(median, min, max) over the rows both runs hold at m_min <= M <= m_max of new time / old time of `way`."""
    before = {(r["dtype"], r["shape"], r["M"]): r["ways"][way]["us"] for r in old
              if r["M"] >= m_min and (m_max is None or r["M"] <= m_max)
              and r["ways"].get(way, {}).get("status") == "ok"}
    ratios = sorted(r["ways"][way]["us"] / before[(r["dtype"], r["shape"], r["M"])] for r in new
                    if (r["dtype"], r["shape"], r["M"]) in before and r["ways"].get(way, {}).get("status") == "ok")
    return (statistics.median(ratios), ratios[0], ratios[-1]) if ratios else None


def _rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        data = read_json(path)
        if data.get("kind") != "bench_mlp":
            raise UsageError(f"{path}: not a bench_mlp results JSON (kind {data.get('kind')!r})")
        rows += data["rows"]
    return rows


def report(rows: list[dict], old: list[dict] | None = None) -> list[str]:
    """The markdown: the run-to-run table against `old` if given, else the regimes and the decode fit."""
    if old is not None:
        lines = ["| way | rows | time this run / the earlier: median | min | max |", "|---|---|---|---|---|"]
        for way in ("ours", "gemm_only"):
            for label, low, high in (("M <= 16", 1, 16), ("32 <= M <= 256", 32, 256), ("M >= 512", 512, None)):
                moved = run_to_run(rows, old, way, low, high)
                if moved:
                    lines.append(f"| {way} | {label} | {moved[0]:.3f} | {moved[1]:.3f} | {moved[2]:.3f} |")
        return lines
    lines = ["| dtype | regime | shapes | rows | ours / gemm_only | ours / best other | floor / ours |",
             "|---|---|---|---|---|---|---|"]
    for s in summarize(rows):
        lines.append(f"| {s['dtype']} | {s['regime']} | {s['shapes']} | {s['rows']} | {s['ours_over_gemm_only']:.3f} "
                     f"| {s['ours_over_best_other']:.3f} | {s['floor_over_ours_mean']:.2f} |")
    lines += ["", "Decode at M = 1, least squares over the shapes: time = weight bytes / bandwidth + fixed cost per "
              "call", "", "| dtype | way | bandwidth TB/s | fixed µs |", "|---|---|---|---|"]
    for dtype in sorted({r["dtype"] for r in rows}):
        for way in ("ours", "gemm_only"):
            fit = decode_fit(rows, way, dtype)
            if fit:
                lines.append(f"| {dtype} | {way} | {fit[0]:.2f} | {fit[1]:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    ap = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench_mlp results JSON(s)")
    ap.add_argument("--compare", nargs="+", type=Path, metavar="OLD_JSON",
                    help="an earlier run's results: how much each way's M >= 512 rows moved between the runs")
    ap.add_argument("--out", type=Path, help="also write the markdown to this file")
    args = ap.parse_args(argv)
    lines = report(_rows(args.results), _rows(args.compare) if args.compare else None)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
