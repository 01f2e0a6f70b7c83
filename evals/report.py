"""Verdicts, the JSON and markdown reports, and the terminal summary.

The verdicts are `verdicts.py`'s, whose docstring gives each rule: per task row, the
per-question checks (accuracy by McNemar, answers and log-likelihood shifts against the
noise floor of the reference run) at alpha over the number of checks; per text, the token
check (the fused-vs-eager KL and its tail against eager's own KL from the reference). Either
says "DIFFERENCE" or "no detectable difference" / "agrees", always with what decided it and
the smallest defect it could have seen, so a reader can judge how strong "no difference" is.
A task without a per-question answer or metric still gets the answers check.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .verdicts import clamp_kl, token_check


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _pts(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.1f} pts"


def row_name(row: dict) -> str:
    return row["task"] + ("" if row["filter"] == "none" else f" [{row['filter']}]") + (" (pooled)" if row["kind"] == "group" else "")


def _detect(p: dict, mdd_unpaired: float | None) -> str:
    if p.get("too_few") or p.get("mdd_paired") is None:
        return "too few questions to detect a difference"
    return f"detectable: {_pts(p['mdd_paired'])} paired, {_pts(mdd_unpaired)} unpaired"


def kl_text(x: float) -> str:
    """A mean KL for the report: one that rounding made negative reads as 0."""
    c = clamp_kl(x)
    return f"0 (within rounding: {x:.2g})" if c == 0.0 and x != 0.0 else f"{x:.3g}"


def _check_text(c: dict) -> str:
    flag = "FLAGGED" if c["flagged"] else "ok"
    if c["check"] == "accuracy":
        return (f"{c['metric']} McNemar p={c['p']:.3g} [{flag}]")
    if c["check"] == "answers":
        if "fused_departs" in c:
            det = "none possible" if c["detectable"] is None else f">= {c['detectable']} fused-only"
            return (f"answers vs reference: fused alone departs on {c['fused_departs']}, eager alone on "
                    f"{c['eager_departs']} (eager vs reference {c['n'] - c['eager_vs_reference']}/{c['n']} same), "
                    f"p={c['p']:.3g}, flags {det} [{flag}]")
        return f"answers changed {c['changed']}/{c['n']} (no reference), p={c['p']:.3g} [{flag}]"
    return (f"log-lik shift > ratio x eager's on {c['worse']}/{c['n']} questions (median shift eager "
            f"{c['median_shift_eager']:.2g}, fused {c['median_shift_fused']:.2g} nats), p={c['p']:.3g} [{flag}]")


def task_verdict(row: dict, alpha: float = 0.05) -> dict:
    """{label, line, significant_metrics, flagged} for one report row (see the module docstring)."""
    checks = row.get("checks") or {"label": "no detectable difference", "flagged": [], "checks": []}
    label = checks["label"]
    parts = []
    for m, v in row["metrics"].items():
        if v.get("paired"):
            p = v["paired"]
            parts.append(
                f"{m} {_pct(v['eager'])} -> {_pct(v['fused'])} (diff {100 * v['diff']:+.2f} pts; "
                f"flips {p['right_to_wrong']} right->wrong, {p['wrong_to_right']} wrong->right; "
                f"McNemar p={p['mcnemar_p']:.3g}; {_detect(p, v['mdd_unpaired'])})"
            )
        else:
            parts.append(f"{m} {v['eager']:.6g} -> {v['fused']:.6g} (diff {v['diff']:+.3g})")
    a = row["answers"]
    parts.append(f"same answer on {a['answers_same']}/{a['n']} ({_pct(a['answer_agreement'])})")
    if a.get("max_abs_loglik_diff") is not None:
        parts.append(f"max |d loglik| {a['max_abs_loglik_diff']:.3g} nats")
    if a.get("identical_text") is not None:
        parts.append(f"identical generations {a['identical_text']}/{a['n']}")
    parts += [_check_text(c) for c in checks["checks"]]
    line = f"{row_name(row)} (n={row['n']}): {label.upper() if label == 'DIFFERENCE' else label}. " + "; ".join(parts)
    sig = sorted(c["metric"] for c in checks["checks"] if c["check"] == "accuracy" and c["flagged"])
    return {"label": label, "line": line, "significant_metrics": sig, "flagged": checks["flagged"]}


def token_verdict(tok: dict, top1_min: float = 0.999, kl_max: float = 1e-4, ratio_max: float = 1.2,
                  tail_ratio: float = 4.0) -> dict:
    """{label, line, rule, flagged, ratios, detectable} for the token-level statistics (`verdicts.token_check`)."""
    ref = tok.get("reference")
    v = token_check(tok, ref["eager"] if ref else None, ref["fused"] if ref else None, mean_ratio=ratio_max,
                    tail_ratio=tail_ratio, top1_min=top1_min, kl_max=kl_max)
    label = v["label"]
    line = (
        f"token-level ({tok['positions']} positions, {tok['windows']} windows of {tok['window']}): {label}. "
        f"mean KL(eager||fused) {kl_text(tok['kl_mean'])} nats (p99 {tok['kl_p99']:.3g}, max {tok['kl_max']:.3g}); "
        f"top-1 agreement {_pct(tok['top1_agreement'])} ({tok['top1_disagreements']} differ); "
        f"max |d logit| {tok['max_abs_logit_diff']:.3g}; perplexity {tok['ppl_eager']:.4f} -> {tok['ppl_fused']:.4f} "
        f"({100 * tok['ppl_rel_diff']:+.4f}%)"
    )
    if ref:
        e, f = ref["eager"], ref["fused"]
        line += (
            f"; noise floor, KL({ref['dtype']} reference||eager): mean {kl_text(e['kl_mean'])}, p99 {e['kl_p99']:.3g}, "
            f"max {e['kl_max']:.3g} nats; KL(reference||fused) mean {kl_text(f['kl_mean'])}; top-1 vs reference eager "
            f"{_pct(e['top1_agreement'])}, fused {_pct(f['top1_agreement'])}; perplexity {e['ppl_reference']:.4f}"
        )
    if v["ratios"]:
        line += "; ratios mean / p99 / max " + " / ".join(f"{v['ratios'][k]:.2f}" for k in ("mean", "p99", "max"))
    if v["flagged"]:
        line += f"; failed: {', '.join(v['flagged'])}"
    if v["detectable"]:
        line += f"; would see {v['detectable']}"
    line += f" [rule: {v['rule']}]"
    return {"label": label, "line": line, "rule": v["rule"], "flagged": v["flagged"], "ratios": v["ratios"],
            "detectable": v["detectable"]}


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=str, allow_nan=True), encoding="utf-8")


def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def _machine(env: dict) -> str:
    """The GPU (or CPU) and host of a `swiglu_patch.provenance.environment` record, in words."""
    host = env.get("host", {})
    cpu = f"{host.get('cpu')}, {host.get('cpus')} CPUs"
    gpu = env.get("gpu", {})
    return cpu if gpu.get("name", "cpu") == "cpu" else f"{gpu['name']} (CUDA {gpu.get('cuda_runtime')}); host {cpu}"


def _settings(config: dict) -> str:
    """The config's groups as ``group: key=value, ...`` parts (None values left out)."""
    parts = []
    for group, values in config.items():
        if isinstance(values, dict):
            kv = ", ".join(f"{k}={v}" for k, v in values.items() if v is not None)
            parts.append(f"{group}: {kv}")
        elif values is None:
            parts.append(f"{group}: none")
    return "; ".join(parts)


def _mdd_cell(p: dict, v: dict) -> str:
    if p.get("too_few") or p.get("mdd_paired") is None:
        return "too few questions"
    return _fmt(100 * p["mdd_paired"], ".1f") + " / " + _fmt(100 * v["mdd_unpaired"], ".1f")


def to_markdown(report: dict) -> str:
    """Render the report dict as markdown: setup, verdicts, score table, paired table, tokens."""
    env = report["environment"]
    v, git = env.get("versions", {}), env.get("git", {})
    dirty = " (dirty)" if git.get("dirty") else ""
    lines = [
        f"# Eager vs fused MLP: {report['model']['name']}",
        "",
        f"- model: `{report['model']['name']}` ({report['model'].get('class')}, {report['model'].get('model_type')}, "
        f"{report['model'].get('dtype')} on {report['model'].get('device')})",
        f"- fused path: {report.get('fused_path')}",
        f"- machine: {_machine(env)}; python {v.get('python')}, torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, lm_eval {v.get('lm_eval')}, triton {v.get('triton')}",
        f"- swiglu-patch commit: `{git.get('commit')}`{dirty} (code sha256 `{env.get('code_sha256', '')[:16]}`)",
        f"- settings: {_settings(report['config'])}",
    ]
    for leaf, info in (report.get("local_data") or {}).items():
        lines.append(f"- {leaf}: local {info['schema']} files {info['files']} (rows {info['rows']})")
    lines += ["", "## Verdicts", ""]
    lines += [f"- {r['verdict']['line']}" for r in report.get("rows", [])]
    if report.get("tokens"):
        lines.append(f"- {report['tokens']['verdict']['line']}")
    rows = report.get("rows", [])
    if rows:
        lines += [
            "", "## Scores", "",
            "| task | metric | n | eager | fused | diff (pts) | McNemar p | detectable paired / unpaired (pts) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            for m, v in r["metrics"].items():
                p = v.get("paired")
                es, fs = v.get("eager_stderr"), v.get("fused_stderr")
                lines.append(
                    f"| {row_name(r)} | {m} | {r['n']} | {_fmt(v['eager'])} ± {_fmt(es)} | {_fmt(v['fused'])} ± {_fmt(fs)} | "
                    f"{100 * v['diff']:+.2f} | {_fmt(p['mcnemar_p'], '.3g') if p else '-'} | "
                    f"{_mdd_cell(p, v) if p else '-'} |"
                )
        lines += [
            "", "## Paired, per question", "",
            "| task | metric | both right | both wrong | right->wrong | wrong->right | same answer | max abs d loglik (nats) | identical generations |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            a = r["answers"]
            for m, v in r["metrics"].items():
                p = v.get("paired")
                if not p:
                    continue
                lines.append(
                    f"| {row_name(r)} | {m} | {p['both_right']} | {p['both_wrong']} | {p['right_to_wrong']} | "
                    f"{p['wrong_to_right']} | {a['answers_same']}/{a['n']} | {_fmt(a['max_abs_loglik_diff'], '.3g')} | "
                    f"{'-' if a['identical_text'] is None else str(a['identical_text']) + '/' + str(a['n'])} |"
                )
    tok = report.get("tokens")
    if tok:
        lines += [
            "", "## Token-level agreement", "",
            f"Text: {tok.get('source')}; {tok['windows']} windows of {tok['window']} tokens = {tok['positions']} positions; "
            f"fused path: {tok['fused_path']}; {tok['seconds']:.1f} s ({tok['positions_per_second']:.0f} positions/s, both models).",
            "",
            "| mean KL | median KL | p99 KL | max KL | top-1 agreement | max abs d logit | mean abs d logit | ppl eager | ppl fused | ppl rel. diff |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {kl_text(tok['kl_mean'])} | {tok['kl_median']:.3g} | {tok['kl_p99']:.3g} | {tok['kl_max']:.3g} | "
            f"{_pct(tok['top1_agreement'])} | {tok['max_abs_logit_diff']:.3g} | {tok['mean_abs_logit_diff']:.3g} | "
            f"{tok['ppl_eager']:.4f} | {tok['ppl_fused']:.4f} | {100 * tok['ppl_rel_diff']:+.4f}% |",
        ]
        ref = tok.get("reference")
        if ref:
            lines += [
                "", f"Against the unpatched model run in {ref['dtype']} (the reference): how far each strays from it.", "",
                "| vs reference | mean KL | p99 KL | max KL | top-1 agreement | max abs d logit | perplexity |",
                "|---|---|---|---|---|---|---|",
                f"| reference | - | - | - | - | - | {ref['eager']['ppl_reference']:.4f} |",
            ]
            for side in ("eager", "fused"):
                x = ref[side]
                lines.append(
                    f"| {side} | {kl_text(x['kl_mean'])} | {x['kl_p99']:.3g} | {x['kl_max']:.3g} | {_pct(x['top1_agreement'])} | "
                    f"{x['max_abs_logit_diff']:.3g} | {x['ppl_' + side]:.4f} |"
                )
    lines += ["", f"Patch report: `{report.get('patch_report', '').splitlines()[0] if report.get('patch_report') else '-'}`", ""]
    return "\n".join(lines)


def terminal_summary(report: dict) -> str:
    """A few lines for the terminal: one verdict per task, the token check, where the files are."""
    out = ["", "=" * 78, f"swiglu-patch eval: {report['model']['name']}  (fused path: {report.get('fused_path')})", "-" * 78]
    out += [r["verdict"]["line"] for r in report.get("rows", [])]
    if report.get("tokens"):
        out.append(report["tokens"]["verdict"]["line"])
    if report.get("files"):
        out += ["-" * 78, f"report: {report['files']['markdown']}  |  {report['files']['json']}"]
    out.append("=" * 78)
    return "\n".join(out)
