"""PNG plots for the memory commands (matplotlib, headless).

- :func:`plot_profile`: peak memory against tokens, one panel per (model, what); colour says eager
  (reds) or fused (blues) and its shade the batch size, markers and solid lines are measured
  points, dashed lines the prediction; one legend for the figure.
- :func:`plot_kv_extra`: extra KV-cache tokens the fused MLP buys, one bar per model at one chunk
  size, or one line per model across chunk sizes.

Titles are wrapped to the figure's width, and the layout makes room for them (no clipping).
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path

from swiglu_patch.memory.tables import MIB

EAGER_COLOR, FUSED_COLOR = "#d62728", "#1f77b4"
# Shades per batch size (first batch darkest), and a marker per batch size.
_SHADES = {"eager": ("#a50f15", "#fb6a4a", "#67000d", "#fcae91"), "fused": ("#08519c", "#6baed6", "#08306b", "#9ecae1")}
_MARKERS = ("o", "s", "^", "D")


def require_matplotlib() -> None:
    """Raise ImportError with the install line when matplotlib is missing (check before the work)."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"plots need matplotlib ({exc}): pip install matplotlib, or drop --plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(title: str, width_in: float, fontsize: float) -> str:
    """`title` wrapped to fit `width_in` inches at `fontsize` points (average glyph ~0.55 em)."""
    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    return textwrap.fill(title, chars)


def plot_profile(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Peak activation memory against tokens, written as a PNG.

    Args:
        rows: dicts with model, what ("mlp" | "prefill"), batch, tokens, path ("eager" | "fused"),
            predicted_bytes and measured_bytes (None when not measured).
        path: the PNG to write.
        title: figure title.

    Returns:
        The path written.
    """
    return _save(profile_figure(rows, title), path, _pyplot())


def profile_figure(rows: list[dict], title: str = ""):
    """The matplotlib Figure of :func:`plot_profile` (the caller saves or closes it)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    _plain = FuncFormatter(lambda v, _: f"{v:g}")
    panels = sorted({(r["model"], r["what"]) for r in rows}, key=lambda p: (p[1] != "mlp", p[0]))
    whats = sorted({w for _, w in panels}, key=lambda w: w != "mlp")
    models = sorted({m for m, _ in panels})
    batches = sorted({r["batch"] for r in rows})
    width = max(6.0, 4.2 * len(models))
    fig, axes = plt.subplots(len(whats), len(models), figsize=(width, 3.4 * len(whats) + 1.4),
                             squeeze=False, sharex=True, layout="constrained")
    style = {(kind, b): (_SHADES[kind][k % len(_SHADES[kind])], _MARKERS[k % len(_MARKERS)])
             for kind in ("eager", "fused") for k, b in enumerate(batches)}
    any_measured = any(r.get("measured_bytes") is not None for r in rows)
    for i, what in enumerate(whats):
        for j, model in enumerate(models):
            ax = axes[i][j]
            series = defaultdict(list)
            for r in rows:
                if r["model"] == model and r["what"] == what:
                    series[(r["path"], r["batch"])].append(r)
            for (kind, batch), pts in sorted(series.items()):
                pts.sort(key=lambda r: r["tokens"])
                color, marker = style[(kind, batch)]
                xs = [r["tokens"] for r in pts]
                ax.plot(xs, [r["predicted_bytes"] / MIB for r in pts], ls="--", lw=1.2, color=color,
                        marker=None if any_measured else marker, mfc="none")
                measured = [(r["tokens"], r["measured_bytes"] / MIB) for r in pts if r.get("measured_bytes") is not None]
                if measured:
                    ax.plot(*zip(*measured), ls="none", marker=marker, ms=6, mfc="none" if batch != batches[0] else color,
                            mec=color, mew=1.4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.xaxis.set_major_formatter(_plain)
            ax.yaxis.set_major_formatter(_plain)
            ax.set_title(f"{model}: {'one MLP' if what == 'mlp' else 'full prefill'}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("peak above weights (MiB)")
            if i == len(whats) - 1:
                ax.set_xlabel("tokens (batch x sequence)")
    handles = [Line2D([], [], color=color, marker=marker, ls="--", mfc="none" if b != batches[0] else color,
                      label=f"{kind} B={b}") for (kind, b), (color, marker) in style.items()]
    handles.append(Line2D([], [], color="0.3", ls="--", label="predicted (dashed)"))
    if any_measured:
        handles.append(Line2D([], [], color="0.3", ls="none", marker="o", label="measured (markers)"))
    per_row = max(2, min(len(handles), int(width / 1.7)))  # a legend entry takes about 1.7 inches at 8 pt
    fig.legend(handles=handles, loc="outside lower center", ncol=per_row, fontsize=8, frameon=False)
    if title:
        fig.suptitle(_wrap(title, width, 10), fontsize=10)
    return fig


def plot_kv_extra(results: list[dict], path: str | Path, title: str = "") -> Path:
    """Extra KV-cache tokens from the fused MLP.

    Args:
        results: ``CapacityResult.to_dict()`` dicts (model, chunk_tokens, extra_tokens_full, extra_pct, tp).
        path: the PNG to write.
        title: figure title.
    """
    plt = _pyplot()
    chunks = sorted({r["chunk_tokens"] for r in results})
    if len(chunks) == 1:
        rows = sorted(results, key=lambda r: r["extra_tokens_full"])
        width = 7.5
        fig, ax = plt.subplots(figsize=(width, 0.32 * len(rows) + 1.4), layout="constrained")
        labels = [f"{r['model']} (tp={r['tp']})" for r in rows]
        bars = ax.barh(labels, [r["extra_tokens_full"] for r in rows], color=FUSED_COLOR)
        for bar, r in zip(bars, rows):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" +{r['extra_tokens_full']:,} ({r['extra_pct']:.2f}%)",
                    va="center", fontsize=7)
        ax.set_xlabel(f"extra KV-cache tokens per GPU, fused vs eager MLP, chunk {chunks[0]}")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlim(0, max(r["extra_tokens_full"] for r in rows) * 1.35 + 1)
    else:
        from matplotlib.ticker import FuncFormatter

        width = 11.0
        fig, (ax, ax_pct) = plt.subplots(1, 2, figsize=(width, 4.5), layout="constrained")
        by_model = defaultdict(list)
        for r in results:
            by_model[(r["model"], r["tp"])].append(r)
        for (model, tp), pts in sorted(by_model.items()):
            pts.sort(key=lambda r: r["chunk_tokens"])
            xs = [r["chunk_tokens"] for r in pts]
            ax.plot(xs, [r["extra_tokens_full"] for r in pts], marker="o", label=f"{model} (tp={tp})")
            ax_pct.plot(xs, [r["extra_pct"] for r in pts], marker="o", label=f"{model} (tp={tp})")
        for a, ylabel in ((ax, "extra KV-cache tokens per GPU"), (ax_pct, "extra KV-cache tokens, % of eager")):
            a.set_xscale("log", base=2)
            a.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            a.set_xlabel("prefill chunk (max batched tokens)")
            a.set_ylabel(ylabel)
            a.grid(True, which="both", alpha=0.3)
        ax_pct.set_yscale("log")
        ax_pct.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(_wrap(title, width, 9), fontsize=9)
    return _save(fig, path, plt)


def _save(fig, path: str | Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
