"""Verdicts, the JSON and markdown reports, and the terminal summary.

Verdict per task row (alpha = the significance level, default 0.05):

- "DIFFERENCE" when the exact McNemar test of any per-question 0/1 metric (acc, acc_norm,
  exact_match) gives p < alpha: the fused model's score moved by more than chance;
- "no detectable difference" otherwise, always with the smallest change the run could have
  detected (paired and unpaired), the flips, the answer agreement and the largest
  log-likelihood change, so a reader can judge how strong "no difference" is;
- "no paired metric" when the task has no per-question 0/1 metric (perplexity tasks).

Verdict of the token-level check: "identical" when no logit moved at all. Otherwise, with a
higher-precision reference run (bf16/fp16 models: the unpatched model in float32), the
quack rule of this project's kernel tests: "agrees" when the fused model's mean KL from the
reference is at most `ratio_max` (2) times eager's own plus 1e-6 nats, else "DIFFERENCE".
Without a reference (float32 models), "DIFFERENCE" when top-1 agreement is below
`top1_min` (0.999) or the mean KL above `kl_max` (1e-4 nats/token), thresholds far above
what fp32 rounding does (docs/accuracy.md), else "agrees".
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _pts(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.1f} pts"


def row_name(row: dict) -> str:
    return row["task"] + ("" if row["filter"] == "none" else f" [{row['filter']}]") + (" (pooled)" if row["kind"] == "group" else "")


def task_verdict(row: dict, alpha: float = 0.05) -> dict:
    """{label, line, significant_metrics} for one report row (see the module docstring)."""
    paired = {m: v for m, v in row["metrics"].items() if v.get("paired")}
    sig = sorted(m for m, v in paired.items() if v["paired"]["mcnemar_p"] < alpha)
    label = "DIFFERENCE" if sig else ("no detectable difference" if paired else "no paired metric")
    parts = []
    for m, v in row["metrics"].items():
        if v.get("paired"):
            p = v["paired"]
            parts.append(
                f"{m} {_pct(v['eager'])} -> {_pct(v['fused'])} (diff {100 * v['diff']:+.2f} pts; "
                f"flips {p['right_to_wrong']} right->wrong, {p['wrong_to_right']} wrong->right; "
                f"McNemar p={p['mcnemar_p']:.3g}; detectable: {_pts(p['mdd_paired'])} paired, "
                f"{_pts(v['mdd_unpaired'])} unpaired)"
            )
        else:
            parts.append(f"{m} {v['eager']:.6g} -> {v['fused']:.6g} (diff {v['diff']:+.3g})")
    a = row["answers"]
    parts.append(f"same answer on {a['answers_same']}/{a['n']} ({_pct(a['answer_agreement'])})")
    if a.get("max_abs_loglik_diff") is not None:
        parts.append(f"max |d loglik| {a['max_abs_loglik_diff']:.3g} nats")
    if a.get("identical_text") is not None:
        parts.append(f"identical generations {a['identical_text']}/{a['n']}")
    line = f"{row_name(row)} (n={row['n']}): {label.upper() if label == 'DIFFERENCE' else label}. " + "; ".join(parts)
    return {"label": label, "line": line, "significant_metrics": sig}


def token_verdict(tok: dict, top1_min: float = 0.999, kl_max: float = 1e-4, ratio_max: float = 2.0) -> dict:
    """{label, line, rule} for the token-level statistics (see the module docstring)."""
    ref = tok.get("reference")
    if tok["max_abs_logit_diff"] == 0.0:
        label, rule = "identical", "no logit changed"
    elif ref:
        ke, kf = ref["eager"]["kl_mean"], ref["fused"]["kl_mean"]
        rule = f"KL({ref['dtype']} ref || fused) <= {ratio_max:g} x KL({ref['dtype']} ref || eager) + 1e-6"
        label = "DIFFERENCE" if kf > ratio_max * ke + 1e-6 else "agrees"
    else:
        rule = f"top-1 agreement >= {top1_min:g} and mean KL <= {kl_max:g} nats"
        label = "DIFFERENCE" if tok["top1_agreement"] < top1_min or tok["kl_mean"] > kl_max else "agrees"
    line = (
        f"token-level ({tok['positions']} positions, {tok['windows']} windows of {tok['window']}): {label}. "
        f"mean KL(eager||fused) {tok['kl_mean']:.3g} nats (p99 {tok['kl_p99']:.3g}, max {tok['kl_max']:.3g}); "
        f"top-1 agreement {_pct(tok['top1_agreement'])} ({tok['top1_disagreements']} differ); "
        f"max |d logit| {tok['max_abs_logit_diff']:.3g}; perplexity {tok['ppl_eager']:.4f} -> {tok['ppl_fused']:.4f} "
        f"({100 * tok['ppl_rel_diff']:+.4f}%)"
    )
    if ref:
        e, f = ref["eager"], ref["fused"]
        line += (
            f"; vs {ref['dtype']} reference: KL eager {e['kl_mean']:.3g}, fused {f['kl_mean']:.3g} nats; top-1 eager "
            f"{_pct(e['top1_agreement'])}, fused {_pct(f['top1_agreement'])}; perplexity {e['ppl_reference']:.4f}"
        )
    line += f" [rule: {rule}]"
    return {"label": label, "line": line, "rule": rule}


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
                    f"{(_fmt(100 * p['mdd_paired'], '.1f') + ' / ' + _fmt(100 * v['mdd_unpaired'], '.1f')) if p else '-'} |"
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
            f"| {tok['kl_mean']:.3g} | {tok['kl_median']:.3g} | {tok['kl_p99']:.3g} | {tok['kl_max']:.3g} | "
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
                    f"| {side} | {x['kl_mean']:.3g} | {x['kl_p99']:.3g} | {x['kl_max']:.3g} | {_pct(x['top1_agreement'])} | "
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
