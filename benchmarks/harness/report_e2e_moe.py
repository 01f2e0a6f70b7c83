"""`bench_e2e_moe`'s markdown report: pure functions of its results JSON (no GPU, no torch).

The JSON's timed rows are `bench_e2e`'s (`report_e2e` describes them); its mode "eager" is the
unpatched model, transformers' default experts path, called "default" here. Ratios are
patched / default tokens/s per round (above 1: faster patched).
"""

from __future__ import annotations

from .report_cells import env_lines, fmt, prefill_table, speedup_cell
from .report_e2e import step_bound

SCHEMA = 1

# Issue 30's targets, patched / default: prefill; dynamic-cache decode by batch (1, then 8 and
# more); the static cache against the default's best decode (either cache) at batch 1 and 32.
PREFILL_TARGET = 1.5
DYNAMIC_TARGETS = {1: 1.3, 8: 1.5, 32: 1.5}
STATIC_TARGETS = {1: 2.0, 32: 2.0}
NEVER_SLOWER = 1.0


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return "met (>= 1.00, never slower)" if value >= NEVER_SLOWER else "**slower** (< 1.00)"
    return ("met" if value >= target else "**missed**") + f" (>= {target:.1f})"


def best_default(data: dict, batch: int) -> float | None:
    """The default's best `generate` tokens/s at `batch`, over both caches."""
    rates = [g["eager"]["per_s"] for g in data.get("generate", []) if g["batch"] == batch]
    return max(rates) if rates else None


def targets(data: dict) -> list[dict]:
    """One row per measured target: what, ratio (median and min of the rounds), target, verdict."""
    rows = []
    for r in data.get("prefill", []):
        s = r["speedup"]
        rows.append({"what": f"prefill {r['prompt']} tokens", "ratio": s["median"], "min": s["min"],
                     "target": PREFILL_TARGET})
    for g in data.get("generate", []):
        s, b = g["speedup"], g["batch"]
        if g["cache"] == "dynamic":
            rows.append({"what": f"dynamic cache, batch {b}", "ratio": s["median"], "min": s["min"],
                         "target": DYNAMIC_TARGETS.get(b)})
        else:
            rows.append({"what": f"static cache, batch {b}: patched static / default static", "ratio": s["median"],
                         "min": s["min"], "target": None})
            best = best_default(data, b)
            rows.append({"what": f"static cache, batch {b}: patched static / default's best decode",
                         "ratio": g["patched"]["per_s"] / best, "min": None, "target": STATIC_TARGETS.get(b)})
    for row in rows:
        row["verdict"] = _verdict(row["ratio"], row["target"])
    return rows


def _header(data: dict) -> list[str]:
    m, s = data["model"], data["settings"]
    what = f"{m['label']} shape" + (", dry run on CPU: numbers mean nothing" if s["dry_run"] else "")
    return [
        f"# End to end, MoE: {what}, transformers' default experts vs patched (apply_fused_mlp)",
        "",
        f"- model: random-init {m['model_type']}, **{m['layers']} of {m['full_layers']} layers**, hidden {m['hidden']}, "
        f"{m['experts']} experts, top-{m['top_k']}, expert intermediate {m['expert_intermediate']}, {m['heads']} heads / "
        f"{m['kv_heads']} KV heads, vocab {m['vocab']}, {m['params'] / 1e9:.2f} B params, {m['dtype']}, attention "
        f"{m['attn']}, torch.inference_mode(); built in {m['build_s']} s",
        f"- default: transformers' `{m['default_experts']}` (`generate` runs its decode steps on batched_mm); "
        f"patched: the fused experts kernels (\"swiglu_patch\"), backend {s['backend']}; one copy of the weights",
        *env_lines(data),
        f"- {s['stat']}; {s['rounds']} rounds; `generate`: prompt {s['prompt']}, {s['new_tokens']} new tokens forced",
    ]


def _targets(data: dict) -> list[str]:
    rows = targets(data)
    if not rows:
        return []
    lines = ["", "## Against the targets", "",
             "| what | patched / default, median | lowest round | target | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | **{r['ratio']:.3f}x** | {fmt(r['min'], '.3f')} | "
                     f"{fmt(r['target'], '.1f')} | {r['verdict']} |")
    return lines


def _first_difference(g: dict) -> str:
    """Where the two modes' greedy tokens first differ, over the batch's sequences."""
    eq, new = g["equal_leading"], g["new_tokens"]
    differ = [n for n in eq if n < new]
    if not differ:
        return f"all {len(eq)} equal"
    return f"{len(differ)} of {len(eq)} differ, the earliest at new token {min(differ)} (0-based)"


def _generate(data: dict) -> list[str]:
    lines = ["", "## HF generate (greedy)", "",
             "tokens/s = batch x new tokens / wall time of the call (the prompt's forward included). static: "
             "`cache_implementation=\"static\"`, the forward compiled by transformers (the capture check below).", "",
             "| cache | batch | default tok/s | patched tok/s | patched / default, median (min-max) | tokens, default "
             "vs patched |", "|---|---|---|---|---|---|"]
    for g in data["generate"]:
        lines.append(f"| {g['cache']} | {g['batch']} | {g['eager']['per_s']:.1f} | {g['patched']['per_s']:.1f} | "
                     f"{speedup_cell(g['speedup'])} | {_first_difference(g)} |")
    return lines


def _capture(data: dict) -> list[str]:
    new = data["settings"]["new_tokens"]
    lines = ["", "## Does the static-cache step capture? (one compiling call, then one counted call)", "",
             f"A captured decode replays a CUDA graph about once per step ({new - 1} steps per call); graph breaks "
             "(dynamo) and skipped CUDA graphs (Inductor) are counted over the compiling call.", "",
             "| batch | mode | first call s | graph replays in the next call | graph breaks | cudagraph skips |",
             "|---|---|---|---|---|---|"]
    for r in data["capture"]:
        for mode in ("eager", "patched"):
            if mode not in r:  # cut by a time limit while compiling
                lines.append(f"| {r['batch']} | {'default' if mode == 'eager' else mode} | not reached | | | |")
                continue
            c = r[mode]
            breaks = "; ".join(f"{n} x {k}" for k, n in c["graph_breaks"].items()) or "0"
            lines.append(f"| {r['batch']} | {'default' if mode == 'eager' else mode} | {c['first_call_s']:.1f} | "
                         f"{c['graph_replays']} | {breaks} | {c['cudagraph_skips']} |")
    return lines


def _profile(data: dict) -> list[str]:
    rows = data["profile"]
    families = list(next((r["eager"]["family_gpu_ms"] for r in rows if r["eager"].get("family_gpu_ms")), []))
    lines = ["", "## Where a decode step's time goes (torch.profiler, one `generate` call per row, / new tokens)", "",
             "experts GPU: kernel time inside the experts modules' forwards (dynamic cache only: hooks would change "
             "a compiled forward). Families: fused = ours (the experts kernels), gemm = cuBLAS/CUTLASS (the "
             "default's batched_mm experts among them), attention, triton = Inductor's and other Triton kernels. "
             "Host gap = wall - GPU: what a faster kernel cannot shorten. The profiler slows the host: read shares.",
             "", "| cache | batch | mode | wall ms | GPU ms | experts GPU ms | experts host ms | "
             + "".join(f"{f} ms | " for f in families) + "host gap ms | GPU busy |",
             "|---|---|---|---|---|---|---|" + "---|" * (len(families) + 2)]
    for r in rows:
        for mode in ("eager", "patched"):
            p = r[mode]
            fam = p.get("family_gpu_ms") or {}
            gap = p["wall_ms"] - p["gpu_ms"] if p["gpu_ms"] is not None else None
            lines.append(f"| {r['cache']} | {r['batch']} | {'default' if mode == 'eager' else mode} | "
                         f"{p['wall_ms']:.2f} | {fmt(p['gpu_ms'], '.2f')} | {fmt(p['mlp_gpu_ms'], '.3f')} | "
                         f"{fmt(p['mlp_host_ms'], '.2f')} | " + "".join(f"{fmt(fam.get(f), '.3f')} | " for f in families)
                         + f"{fmt(gap, '.2f')} | {fmt(p['gpu_busy'], '.2f')} |")
    return lines + _bounds(data)


def _bounds(data: dict) -> list[str]:
    """Per profiled decode row: the GPU time the patch saves per step and the speedup that buys
    a step of the default's unprofiled `generate` length when its host time stays as it is."""
    step = {(g["cache"], g["batch"]): (g["eager"]["median_s"] * 1e3 / g["new_tokens"], g["speedup"]["median"])
            for g in data.get("generate", [])}
    rows = [r for r in data["profile"] if r["eager"]["gpu_ms"] is not None and (r["cache"], r["batch"]) in step]
    if not rows:
        return []
    lines = ["", "What the GPU time saved can buy: bound = the default's unprofiled step (`generate` wall / new "
             "tokens) over that step less the GPU ms the patch saves, its host time unchanged. A measured speedup "
             "above the bound came from host time the patch also saved. Host-free bound (dynamic cache): the "
             "default's profiled wall over that wall less its experts' host time, what a host-bound step gains "
             "at most if the experts cost the host nothing (the profiler inflates host time: an estimate).", "",
             "| cache | batch | default step ms | GPU saved ms per step | bound | host-free bound | measured |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, measured = step[r["cache"], r["batch"]]
        e = r["eager"]
        saved = e["gpu_ms"] - r["patched"]["gpu_ms"]
        bound = f"{step_bound(ms, saved):.3f}x" if saved < ms else "–"
        free = f"{e['wall_ms'] / (e['wall_ms'] - e['mlp_host_ms']):.3f}x" if e["mlp_host_ms"] is not None else "–"
        lines.append(f"| {r['cache']} | {r['batch']} | {ms:.2f} | {saved:.3f} | {bound} | {free} | {measured:.3f}x |")
    return lines


def _prefill_profile(data: dict) -> list[str]:
    rows = data["prefill_profile"]
    lines = ["", "## Where a prefill's time goes (torch.profiler, one forward per row, the experts marked)", "",
             "Bound with the experts free: the default's profiled wall time over that time less its experts' GPU "
             "time (a prefill is GPU-bound): no experts kernel can make this prefill faster than that.", "",
             "| prompt | mode | wall ms | GPU ms | experts GPU ms (share of GPU) | experts host ms | GPU busy | "
             "bound with the experts free |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["eager"]
        free = e["wall_ms"] / (e["wall_ms"] - e["mlp_gpu_ms"]) if e["mlp_gpu_ms"] is not None else None
        for mode in ("eager", "patched"):
            p = r[mode]
            share = p["mlp_gpu_ms"] / p["gpu_ms"] if p["gpu_ms"] and p["mlp_gpu_ms"] is not None else None
            lines.append(f"| {r['prompt']} | {'default' if mode == 'eager' else mode} | {p['wall_ms']:.2f} | "
                         f"{fmt(p['gpu_ms'], '.2f')} | {fmt(p['mlp_gpu_ms'], '.2f')} ({fmt(share, '.0%')}) | "
                         f"{fmt(p['mlp_host_ms'], '.2f')} | {fmt(p['gpu_busy'], '.2f')} | "
                         + (f"{fmt(free, '.3f')}x |" if mode == "eager" else "|"))
    return lines


def _rates(row: dict, mode: str, work: float) -> str:
    return ", ".join(f"{work / t:.1f}" for t in row[mode]["rounds_s"])


def _ms_cell(count: int, ms: dict) -> str:
    if not count:
        return "–"
    return f"{count}: {fmt(ms['median'], '.2f')} ({fmt(ms['p90'], '.2f')}, {fmt(ms['max'], '.1f')})"


def _watch_cells(w: dict) -> str:
    gc_counts = "/".join(str(n) for n in w["gc_collections"])
    marked = w.get("marked_ms", {}).get("median")
    return (f"{_ms_cell(w['prompts'], w['prompt_ms'])} | {_ms_cell(w['steps'], w['step_ms'])} | {fmt(marked, '.2f')} | "
            f"{fmt(w['gap_ms']['median'], '.2f')} | {gc_counts} ({w['gc_ms']:.1f} ms) | {w['alloc_retries']} | "
            f"{w['peak_reserved_gib']:.2f} / {w['peak_allocated_gib']:.2f} |")


def _watch(data: dict) -> list[str]:
    """Per watched row and mode: the rounds' rates, the forwards' host time, the collector and the allocator."""
    rows = [("prefill", r["prompt"], r["prompt"], r) for r in data.get("prefill", []) if "watch" in r]
    rows += [(f"generate {g['cache']}", g["batch"], g["batch"] * g["new_tokens"], g)
             for g in data.get("generate", []) if "watch" in g]
    if not rows:
        return []
    lines = ["", "## Host, collector and allocator per row (no profiler; every call of the row, first call included)",
             "", "rates: tokens/s of each round, in order. prompt and step forwards: count: ms of one forward of "
             "the model (hooks on its top module) over a prompt or a one-token decode step, median (p90, max): "
             "host time, and any wait for the GPU inside it. experts ms: the host time inside the experts "
             "modules' forwards in one decode step, median. gap ms: median from a forward's end to the same "
             "model's next decode step (`generate`'s loop, its synchronisation included). gc: Python's "
             "collections by generation 0/1/2 (their time) charged to the mode whose forward ran last. alloc "
             "retries: cudaMallocs that failed, freed the allocator's cache and retried. reserved / allocated: the "
             "most seen after a forward. A compiled (static) row has no hooks: its figures are the row's, under "
             "all.", "",
             "| row | batch or prompt | mode | rates per round | prompt forwards | step forwards | experts ms | gap ms | "
             "gc | alloc retries | reserved / allocated GiB | free GiB, start / end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for what, size, work, r in rows:
        w = r["watch"]
        free = "/".join(fmt(x, ".1f") for x in w["free_gib"])
        for mode in ("eager", "patched"):
            name = "default" if mode == "eager" else mode
            figures = _watch_cells(w[mode]) if mode in w else (_watch_cells(w["all"]) if mode == "eager"
                                                                else "| | | | | | |")
            lines.append(f"| {what} | {size} | {name} | {_rates(r, mode, work)} | {figures} {free} |")
    return lines


def _agreement(data: dict) -> list[str]:
    a = data.get("agreement")
    if not a:
        return []
    lines = ["", "## Agreement of patched with the default", "",
             f"- logits on a {a['probe_tokens']}-token prompt: max |diff| {a['max_abs_logit_diff']:.3g}, relative "
             f"{a['rel_logit_diff']:.2e}, top-1 agreement {a['top1_agree']:.4f}",
             f"- routing decisions (a layer's top-k expert set for a token) that differ on that prompt: "
             f"{a['routing_differs']:.4%} (a flip in one layer changes the inputs of the next)"]
    load = a.get("routing_load")
    if load:
        busy = load["busiest_over_mean"]
        lines.append(f"- the default's routing of that prompt ({load['pairs_per_layer']} pairs a layer): the busiest "
                     f"expert holds {min(busy):.1f}x to {max(busy):.1f}x the mean (median {sorted(busy)[len(busy) // 2]:.1f}x), "
                     f"{min(load['experts_used'])} to {max(load['experts_used'])} experts used per layer")
    if a["generate_leading_tokens"]:
        lines.append("- leading greedy tokens equal (first sequence; fewest over the batch): " + ", ".join(
            f"{g['cache']} batch {g['batch']}: {g['equal']} ({g['fewest_equal']}) of {g['of']}"
            for g in a["generate_leading_tokens"]))
    return lines + ["", "```", data["patch_report"], "```"]


def render_markdown(data: dict) -> str:
    """The whole report as markdown (parts a run did not reach are left out)."""
    lines = _header(data) + _targets(data)
    for key, part in (("prefill", lambda d: prefill_table(d["prefill"], "default")), ("prefill_profile", _prefill_profile), ("generate", _generate),
                      ("capture", _capture), ("profile", _profile), ("generate", _watch)):
        if data.get(key):
            lines += part(data)
    return "\n".join(lines + _agreement(data)) + "\n"


def summary_lines(data: dict) -> list[str]:
    """The targets, one line each, for the terminal."""
    m = data["model"]
    return [f"[bench_e2e_moe] {m['label']}, {m['layers']} layers, {data['env']['gpu'].get('name')}, "
            f"commit {data['env']['git']['commit']}"] + [
        f"  {r['what']}: {r['ratio']:.3f}x, {r['verdict']}" for r in targets(data)]
