"""Cells and blocks the end-to-end reports share (`report_e2e`, `report_e2e_moe`): pure
functions of a results JSON, no GPU, no torch.

A results JSON's `env` is `swiglu_patch.provenance.environment`'s; a timed row stores per mode
("eager": the unpatched model, "patched") its `per_s` and `peak_extra_mib`, and `speedup`
(median, min, max of the per-round ratios patched / eager).
"""

from __future__ import annotations


def fmt(v, spec: str) -> str:
    """`v` formatted by `spec`, or an en dash for None."""
    return "–" if v is None else format(v, spec)


def speedup_cell(s: dict) -> str:
    """A speedup's median in bold and its rounds' spread: **1.234x** (1.100-1.300)."""
    return f"**{s['median']:.3f}x** ({s['min']:.3f}-{s['max']:.3f})"


def env_lines(data: dict) -> list[str]:
    """The GPU and versions line, and the commit, date and host line of a report's header."""
    env = data["env"]
    git, v, gpu = env["git"], env["versions"], env["gpu"]
    dirty = " (working tree had uncommitted changes)" if git.get("dirty") else ""
    return [f"- GPU: {gpu.get('name')}, driver {gpu.get('driver', '–')}; torch {v.get('torch')}, triton "
            f"{v.get('triton')}, transformers {v.get('transformers')}, python {v.get('python')}",
            f"- commit {git['commit']} ({git['source']}){dirty}; measured {env['date_utc']}; host "
            f"{env['host'].get('cpu')}"]


def prefill_table(rows: list[dict], unpatched: str) -> list[str]:
    """The prefill section: per prompt length the modes' tokens/s, the speedup and the peak
    memory above the weights; `unpatched` names the "eager" mode ("eager", "default")."""
    lines = ["", "## Prefill (batch 1, use_cache=True, logits_to_keep=1)", "",
             f"| prompt tokens | {unpatched} tok/s | patched tok/s | patched / {unpatched}, median (min-max) | "
             f"{unpatched} peak extra MiB | patched peak extra MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        e, p = r["eager"], r["patched"]
        lines.append(f"| {r['prompt']} | {e['per_s']:.0f} | {p['per_s']:.0f} | {speedup_cell(r['speedup'])} | "
                     f"{fmt(e['peak_extra_mib'], '.0f')} | {fmt(p['peak_extra_mib'], '.0f')} |")
    return lines
