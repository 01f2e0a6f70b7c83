"""Turn the MLP benchmark's results JSON into a markdown report and PNG plots.

Pure functions of the JSON (no GPU, no torch), so `--render results.json` rebuilds both on
any machine. Everything derived (ratios, floor fraction, TFLOP/s, goals) is computed here
from the raw microseconds the JSON stores, never stored twice.

Row format (one per dtype, shape and M)::

    {"dtype": "bfloat16", "shape": "llama-3-8b", "M": 16, "K": 4096, "I": 14336,
     "activation": "silu", "flops": int, "min_bytes": int, "floor_us": float,
     "ways": {"ours": {"status": "ok", "us": 93.1, "rel_err": 1.9e-3, "setup_s": 0.4},
              "liger": {"status": "skipped", "reason": "..."}, ...}}

status is "ok" (checked, then timed), "failed" (error above the dtype's bound: not timed),
"error" (raised), or "skipped" (not available here, or out of time budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

OUTPUT_WAYS = ("hf_eager", "torch_compile", "liger")  # compute the MLP's output; gemm_only does not
WAY_STYLE = {  # colour, marker for the plots
    "ours": ("tab:red", "o"),
    "gemm_only": ("tab:gray", "s"),
    "hf_eager": ("tab:blue", "^"),
    "torch_compile": ("tab:green", "v"),
    "liger": ("tab:purple", "D"),
}


def way_us(row: dict, way: str) -> float | None:
    """The way's median µs if it was checked and timed, else None."""
    w = row["ways"].get(way)
    return w["us"] if w and w.get("status") == "ok" and w.get("us") else None


def best_other(row: dict) -> tuple[str, float] | None:
    """(name, µs) of the fastest way other than ours that computes the output, or None."""
    timed = [(way_us(row, w), w) for w in OUTPUT_WAYS if way_us(row, w) is not None]
    if not timed:
        return None
    us, name = min(timed)
    return name, us


def derived(row: dict) -> dict:
    """Ratios of one row; each value is None where an input is missing.

    Returns:
        {"ours_over_gemm", "ours_over_best", "best_other", "floor_frac", "ours_tflops"}
    """
    ours, gemm = way_us(row, "ours"), way_us(row, "gemm_only")
    best = best_other(row)
    return {
        "ours_over_gemm": ours / gemm if ours and gemm else None,
        "ours_over_best": ours / best[1] if ours and best else None,
        "best_other": best[0] if best else None,
        "floor_frac": row["floor_us"] / ours if ours and row.get("floor_us") else None,
        "ours_tflops": row["flops"] / (ours * 1e-6) / 1e12 if ours else None,
    }


@dataclass(frozen=True)
class Goal:
    """One target of issue 3, judged per row where it applies."""

    key: str
    text: str
    applies: Callable[[int], bool]
    metric: str  # a key of `derived`
    target: float
    higher_is_better: bool

    def judge(self, row: dict) -> tuple[str, float | None]:
        """("met" | "missed" | "n/a" (not measurable) | "" (does not apply), measured value)."""
        if not self.applies(row["M"]):
            return "", None
        value = derived(row)[self.metric]
        if value is None:
            return "n/a", None
        ok = value >= self.target if self.higher_is_better else value <= self.target
        return ("met" if ok else "missed"), value


GOALS = (
    Goal("prefill_vs_gemm", "M >= 512: ours <= 1.00x gemm_only", lambda m: m >= 512, "ours_over_gemm", 1.00, False),
    Goal("decode_floor", "M <= 16: floor / ours >= 0.92", lambda m: m <= 16, "floor_frac", 0.92, True),
    Goal("vs_best_other", "every M: ours <= 1.02x the fastest other way", lambda m: True, "ours_over_best", 1.02, False),
)


def _f(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _cell(row: dict, way: str) -> str:
    w = row["ways"].get(way)
    if not w or w.get("status") == "skipped":
        return "n/a"
    if w["status"] == "ok":
        return f"{w['us']:.1f}"
    if w["status"] == "failed":
        err = w.get("rel_err")
        return f"FAIL (err {math.inf if err is None else err:.1e})"  # None: inf or nan, sanitized
    return "ERROR"


def _shape_label(row: dict, shapes: dict) -> str:
    s = shapes.get(row["shape"], {})
    return f"{s.get('models', row['shape'])} (K={row['K']}, I={row['I']}, {row['activation']})"


def _tflops(v: float | None) -> str:
    return "–" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.3g}")


def _ordered(data: dict) -> list[dict]:
    """Rows by dtype (as run), shape (as in the shape table), then M."""
    dtypes = {d: n for n, d in enumerate(data["peaks"])}
    shapes = {s["name"]: n for n, s in enumerate(data["shapes"])}
    return sorted(data["rows"], key=lambda r: (dtypes.get(r["dtype"], 99), shapes.get(r["shape"], 99), r["M"]))


def _m_label(m: int) -> str:
    return f"{m // 1024}k" if m >= 1024 and m % 1024 == 0 else str(m)


def _grouped(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["shape"]), []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: r["M"])
    return groups


def _header(data: dict) -> list[str]:
    env, s = data["env"], data["settings"]
    gpu, v, git = env["gpu"], env["versions"], env["git"]
    dirty = " (working tree had uncommitted changes)" if git.get("dirty") else ""
    return [
        "# Gated MLP, first half: act(x Wg^T) * (x Wu^T)",
        "",
        f"- GPU: {gpu.get('name')}, driver {gpu.get('driver', '–')}, CUDA {gpu.get('cuda_runtime', '–')}",
        f"- torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, "
        f"liger-kernel {v.get('liger-kernel') or 'absent'}, python {v.get('python')}",
        f"- commit {git['commit']} ({git['source']}){dirty}; measured {env['date_utc']}",
        f"- timing: {s['timer']}; error bound per dtype: "
        + ", ".join(f"{k} {b:.1e}" for k, b in s["rel_err_bounds"].items()),
        "- µs are medians; `floor` = max(flops / matmul peak, min bytes / copy bandwidth), peaks measured in "
        "this run; `best other` = fastest of hf_eager, torch_compile, liger (gemm_only computes no activation).",
    ]


def shape_tables(data: dict) -> list[str]:
    """One markdown table per (dtype, shape): µs per way, ratios, floor fraction, TFLOP/s."""
    ways, shapes = data["ways"], {s["name"]: s for s in data["shapes"]}
    lines: list[str] = []
    dtype_seen = None
    for (dtype, _), rows in _grouped(_ordered(data)).items():
        if dtype != dtype_seen:
            p = data["peaks"][dtype]
            lines += ["", f"## {dtype}", "", f"Peaks this run: matmul {_tflops(p['matmul_tflops'])} TFLOP/s "
                      f"({p['matmul_n']}^3), copy {p['copy_tbps']:.2f} TB/s (read + written)."]
            dtype_seen = dtype
        lines += ["", f"### {_shape_label(rows[0], shapes)}", ""]
        lines.append("| M | " + " | ".join(f"{w} µs" for w in ways)
                     + " | floor µs | ours/gemm_only | ours/best other | floor/ours | ours TFLOP/s |")
        lines.append("|" + "---|" * (len(ways) + 6))
        for r in rows:
            d = derived(r)
            best = f"{_f(d['ours_over_best'], '.3f')} ({d['best_other']})" if d["best_other"] else "–"
            lines.append(f"| {r['M']} | " + " | ".join(_cell(r, w) for w in ways)
                         + f" | {_f(r.get('floor_us'), '.1f')} | {_f(d['ours_over_gemm'], '.3f')} | {best}"
                         + f" | {_f(d['floor_frac'], '.2f')} | {_tflops(d['ours_tflops'])} |")
    return lines


def goals_table(data: dict) -> list[str]:
    """Per-goal summary, then every row's verdict with its measured ratio."""
    rows = _ordered(data)
    lines = ["", "## Goals", ""]
    for g in GOALS:
        verdicts = [g.judge(r)[0] for r in rows]
        applicable = [v for v in verdicts if v]
        met = sum(v == "met" for v in applicable)
        unmeasured = sum(v == "n/a" for v in applicable)
        lines.append(f"- {g.text}: met in {met} of {len(applicable)} rows"
                     + (f" ({unmeasured} not measurable)" if unmeasured else ""))
    lines += ["", "| dtype | shape | M | " + " | ".join(g.text for g in GOALS) + " |", "|" + "---|" * (3 + len(GOALS))]
    for r in rows:
        cells = []
        for g in GOALS:
            verdict, value = g.judge(r)
            cells.append(verdict if value is None else f"{verdict} {value:.3f}")
        lines.append(f"| {r['dtype']} | {r['shape']} | {r['M']} | " + " | ".join(cells) + " |")
    return lines


def accuracy_table(data: dict) -> list[str]:
    """Worst relative error of each way per (dtype, shape), and every way not timed with why."""
    ways = data["ways"]
    lines = ["", "## Accuracy (max relative error over M against float64, of the eager call and, where timed as a "
             "graph, of its replay; bound per dtype above)", "",
             "| dtype | shape | " + " | ".join(ways) + " |", "|" + "---|" * (2 + len(ways))]
    problems: list[str] = []
    for (dtype, shape), rows in _grouped(_ordered(data)).items():
        cells = []
        for w in ways:
            errs = [max(r["ways"][w]["rel_err"], r["ways"][w].get("rel_err_graph", 0.0)) for r in rows
                    if r["ways"].get(w, {}).get("rel_err") is not None]
            cells.append(_f(max(errs), ".1e") if errs else "–")
            for r in rows:
                e = r["ways"].get(w, {})
                if e.get("status") in ("failed", "error"):
                    problems.append(f"- {dtype} {shape} M={r['M']} {w}: {e['status']}: {e.get('reason', '')}")
        lines.append(f"| {dtype} | {shape} | " + " | ".join(cells) + " |")
    skipped = sorted({f"- {w}: {e['reason']}" for r in data["rows"] for w, e in r["ways"].items()
                      if e.get("status") == "skipped" and e.get("reason")})
    if problems:
        lines += ["", "Failed or raised (not timed):", "", *problems]
    if skipped:
        lines += ["", "Skipped:", "", *skipped]
    return lines


def merge_results(runs: list[dict]) -> dict:
    """One results dict from several runs (split across device calls, or one per dtype).

    env and settings come from the first run (a merged report notes every commit). A row
    measured in a later run replaces one that was skipped or absent; a row measured twice
    keeps the later measurement.

    Raises:
        ValueError: no runs, or a run that is not a bench_mlp result.
    """
    if not runs or any(r.get("kind") != "bench_mlp" for r in runs):
        raise ValueError("merge_results: expected one or more bench_mlp results JSONs")
    if len(runs) == 1:
        return runs[0]
    merged = {**runs[0], "shapes": [], "ways": [], "peaks": {}, "rows": []}
    commits = list(dict.fromkeys(r["env"]["git"]["commit"] for r in runs))
    if len(commits) > 1:
        merged["env"] = {**runs[0]["env"], "git": {**runs[0]["env"]["git"], "commit": " + ".join(commits)}}
    bounds: dict = {}
    rows: dict[tuple, dict] = {}
    for run in runs:
        merged["shapes"] += [s for s in run["shapes"] if s not in merged["shapes"]]
        merged["ways"] += [w for w in run["ways"] if w not in merged["ways"]]
        merged["peaks"].update(run["peaks"])
        bounds.update(run["settings"].get("rel_err_bounds", {}))
        for row in run["rows"]:
            key = (row["dtype"], row["shape"], row["M"])
            measured = any(w.get("status") != "skipped" for w in row["ways"].values())
            if measured or key not in rows:
                rows[key] = row
    order = list(WAY_STYLE)
    merged["ways"].sort(key=lambda w: order.index(w) if w in order else len(order))
    merged["settings"] = {**runs[0]["settings"], "rel_err_bounds": bounds}
    merged["rows"] = list(rows.values())
    return merged


def render_markdown(data: dict) -> str:
    """The whole report as markdown."""
    return "\n".join(_header(data) + shape_tables(data) + goals_table(data) + accuracy_table(data)) + "\n"


def render_plots(data: dict, out_dir: Path) -> list[Path]:
    """One PNG per dtype: time / gemm_only against M (log x), one subplot per shape.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = {s["name"]: s for s in data["shapes"]}
    written = []
    groups = _grouped(_ordered(data))
    for dtype in dict.fromkeys(d for d, _ in groups):
        keys = [k for k in groups if k[0] == dtype]
        ncols = min(3, len(keys))
        nrows = math.ceil(len(keys) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            rows = groups[key]
            for way in data["ways"] + ["floor"]:
                pts = []
                for r in rows:
                    gemm = way_us(r, "gemm_only")
                    us = r.get("floor_us") if way == "floor" else way_us(r, way)
                    if gemm and us:
                        pts.append((r["M"], us / gemm))
                if not pts:
                    continue
                colour, marker = WAY_STYLE.get(way, ("black", "."))
                style = dict(color="black", linestyle="--", marker="") if way == "floor" else dict(color=colour, marker=marker)
                ax.plot(*zip(*pts), label=way, markersize=4, linewidth=1.4, **style)
            ax.set_ylim(top=min(ax.get_ylim()[1], 2.0))  # a way 3x slower would flatten the rest
            ax.set_xscale("log", base=2)
            m_all = [r["M"] for r in rows]
            ticks = [m for m in (4**e for e in range(12)) if min(m_all) <= m <= max(m_all)] or m_all
            ax.set_xticks(ticks, [_m_label(m) for m in ticks])
            ax.minorticks_off()
            ax.axhline(1.0, color="gray", linewidth=0.6)
            ax.set_title(_shape_label(rows[0], shapes), fontsize=9)
            ax.set_xlabel("tokens M")
            ax.set_ylabel("time / gemm_only")
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        legend: dict = {}  # label -> handle, over all subplots (the first may lack a way)
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(lab, h)
        handles, labels = list(legend.values()), list(legend)
        fig.suptitle(f"{dtype} on {data['env']['gpu'].get('name')}: time relative to cuBLAS on the stacked "
                     "weight (lower is faster)", y=0.995, fontsize=10)
        if handles:
            fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.985 - 0.02 * (nrows == 1)),
                       ncol=len(labels), fontsize=9, frameon=False)
        else:
            fig.text(0.5, 0.5, "nothing was timed", ha="center", fontsize=14)
        fig.tight_layout(rect=(0, 0, 1, 0.9 if nrows == 1 else 0.94))
        path = out_dir / f"mlp_{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def render(data: dict, out_dir: Path) -> list[Path]:
    """Write results.md and the PNGs for `data` under out_dir; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(render_markdown(data))
    return [md, *render_plots(data, out_dir)]


def summary_lines(data: dict) -> list[str]:
    """A short table for the terminal: ours µs and its ratios per row."""
    lines = [f"{'dtype':9} {'shape':15} {'M':>6} {'ours us':>9} {'/gemm':>7} {'/best':>7} {'floor/':>7}"]
    for r in _ordered(data):
        d = derived(r)
        lines.append(f"{r['dtype']:9} {r['shape']:15} {r['M']:>6} {_f(way_us(r, 'ours'), '9.1f'):>9} "
                     f"{_f(d['ours_over_gemm'], '.3f'):>7} {_f(d['ours_over_best'], '.3f'):>7} "
                     f"{_f(d['floor_frac'], '.2f'):>7}")
    return lines
