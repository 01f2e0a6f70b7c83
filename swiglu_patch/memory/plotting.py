"""PNG plots for the memory commands (matplotlib, headless).

- :func:`plot_profile`: peak memory against tokens, eager and fused, measured (solid) and
  predicted (dashed), one panel per (model, what).
- :func:`plot_kv_extra`: extra KV-cache tokens the fused MLP buys, one bar per model at one chunk
  size, or one line per model across chunk sizes.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path

from swiglu_patch.memory.tables import MIB

EAGER_COLOR, FUSED_COLOR = "#d62728", "#1f77b4"


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'swiglu-patch[plot]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Peak activation memory against tokens.

    Args:
        rows: dicts with model, what ("mlp" | "prefill"), batch, tokens, path ("eager" | "fused"),
            predicted_bytes and measured_bytes (None when not measured).
        path: the PNG to write.
        title: figure title.
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    _plain = FuncFormatter(lambda v, _: f"{v:g}")
    panels = sorted({(r["model"], r["what"]) for r in rows}, key=lambda p: (p[1] != "mlp", p[0]))
    whats = sorted({w for _, w in panels}, key=lambda w: w != "mlp")
    models = sorted({m for m, _ in panels})
    fig, axes = plt.subplots(len(whats), len(models), figsize=(4.2 * len(models), 3.6 * len(whats)),
                             squeeze=False, sharex=True)
    for i, what in enumerate(whats):
        for j, model in enumerate(models):
            ax = axes[i][j]
            series = defaultdict(list)
            for r in rows:
                if r["model"] == model and r["what"] == what:
                    series[(r["path"], r["batch"])].append(r)
            for (kind, batch), pts in sorted(series.items()):
                pts.sort(key=lambda r: r["tokens"])
                color = EAGER_COLOR if kind == "eager" else FUSED_COLOR
                marker = "o" if batch == 1 else "s"
                xs = [r["tokens"] for r in pts]
                ax.plot(xs, [r["predicted_bytes"] / MIB for r in pts], ls="--", color=color, alpha=0.7,
                        label=f"{kind} B={batch} predicted")
                measured = [(r["tokens"], r["measured_bytes"] / MIB) for r in pts if r.get("measured_bytes") is not None]
                if measured:
                    ax.plot(*zip(*measured), ls="-", marker=marker, color=color, label=f"{kind} B={batch} measured")
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
    axes[0][0].legend(fontsize=6, loc="upper left")
    if title:
        fig.suptitle(textwrap.fill(title, 140), fontsize=10)
    fig.tight_layout()
    return _save(fig, path, plt)


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
        fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.4))
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

        fig, (ax, ax_pct) = plt.subplots(1, 2, figsize=(11, 4.5))
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
        fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: str | Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
