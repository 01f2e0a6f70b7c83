"""`bench_e2e`'s markdown report: pure functions of its results JSON (no GPU, no torch).

Every timed part stores, per mode ("eager", "patched"), the seconds of each round
(`rounds_s`), their median (`median_s`) and the median rate (`per_s`: tokens/s), and the
per-round speedup patched / eager (`speedup`: median, min, max, rounds; above 1 is faster
patched). `host` rows store host µs statistics per mode and `patched_over_eager` (below 1 is
less host time patched).
"""

from __future__ import annotations

from .report_cells import env_lines, fmt, prefill_table, speedup_cell

SCHEMA = 2

# Issue 18's targets: patched / eager speedup of HF generate by cache kind, host time per MLP call.
GENERATE_TARGETS = {"dynamic": 1.00, "static": 1.02}
HOST_TARGET = 0.75


def leading(a: list, b: list) -> int:
    """How many leading tokens two greedy decodes share."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return ("met" if ok else "missed") + f" ({'>=' if higher_is_better else '<='} {target:.2f})"


def _header(data: dict) -> list[str]:
    m, s = data["model"], data["settings"]
    what = f"{m['label']} shape" + (", dry run on CPU: numbers mean nothing" if s["dry_run"] else "")
    return [
        f"# End to end: {what}, eager vs patched (apply_fused_mlp)",
        "",
        f"- model: random-init {m['model_type']}, hidden {m['hidden']}, intermediate {m['intermediate']}, "
        f"{m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}, **{m['layers']} of {m['full_layers']} "
        f"layers**, {m['params'] / 1e9:.2f} B params, {m['dtype']}, {m['attn']}, torch.inference_mode()",
        *env_lines(data),
        f"- {s['stat']}; {s['rounds']} rounds",
    ]


def _generate(data: dict) -> list[str]:
    s = data["settings"]
    host = {h["batch"]: h for h in data.get("host", [])}
    lines = ["", f"## HF generate (greedy, {s['new_tokens']} new tokens forced, prompt {s['prompt']})", "",
             "tokens/s = batch x new tokens / wall time of the call; speedup = patched tok/s / eager tok/s per "
             "round. dynamic: the default DynamicCache (host-bound); static: `cache_implementation=\"static\"` "
             "(on CUDA transformers compiles the forward; the first call, not timed, is in the last column). "
             "Host µs per MLP call: the `host` section below.", "",
             "| cache | batch | eager tok/s | patched tok/s | speedup, median (min-max) | target | host µs per MLP "
             "call, eager / patched | first call s, eager / patched |", "|---|---|---|---|---|---|---|---|"]
    for r in data["generate"]:
        h = host.get(r["batch"])
        host_cell = f"{h['eager']['median_us']:.1f} / {h['patched']['median_us']:.1f}" if h else "–"
        first = r["first_call_s"]
        lines.append(f"| {r['cache']} | {r['batch']} | {r['eager']['per_s']:.1f} | {r['patched']['per_s']:.1f} | "
                     f"{speedup_cell(r['speedup'])} | "
                     f"{_verdict(r['speedup']['median'], GENERATE_TARGETS[r['cache']], True)} | {host_cell} | "
                     f"{first['eager']:.1f} / {first['patched']:.1f} |")
    lines += ["", "Per-round speedups:", ""]
    for r in data["generate"]:
        lines.append(f"- {r['cache']}, batch {r['batch']}: " + ", ".join(f"{x:.3f}" for x in r["speedup"]["rounds"]))
    return lines


def _graph(data: dict) -> list[str]:
    lines = ["", "## Decode, the step captured in a CUDA graph (static KV cache, greedy)", "",
             "`harness/decode_graph.py`: the prompt as one forward, then one graph replay per token (uncaptured on "
             "CPU); ms per step = CUDA-event time of the replays / (new - 1).", "",
             "| batch | eager ms/step | patched ms/step | eager tok/s | patched tok/s | speedup, median (min-max) |",
             "|---|---|---|---|---|---|"]
    for r in data["graph"]:
        e, p = r["eager"], r["patched"]
        lines.append(f"| {r['batch']} | {e['median_s'] * 1e3:.3f} | {p['median_s'] * 1e3:.3f} | {e['per_s']:.1f} | "
                     f"{p['per_s']:.1f} | {speedup_cell(r['speedup'])} |")
    return lines


def _host(data: dict) -> list[str]:
    lines = ["", "## Host time per MLP call (layer 0's MLP, x [batch, 1, hidden], from an idle device)", "",
             "Each call timed alone after a synchronize: the Python, dispatcher and launch work a host-bound "
             "decode step pays per layer. Median (p10-p90) over the calls.", "",
             "| batch | eager `forward` µs | patched `forward` µs | patched / eager | target |", "|---|---|---|---|---|"]
    for r in data["host"]:
        e, p = r["eager"], r["patched"]
        lines.append(f"| {r['batch']} | {e['median_us']:.1f} ({e['p10_us']:.1f}-{e['p90_us']:.1f}) | "
                     f"{p['median_us']:.1f} ({p['p10_us']:.1f}-{p['p90_us']:.1f}) | {r['patched_over_eager']:.3f} | "
                     f"{_verdict(r['patched_over_eager'], HOST_TARGET, False)} |")
    return lines


def _profile(data: dict) -> list[str]:
    lines = ["", "## Where a decode step's time goes (torch.profiler, one `generate` call per row)", "",
             "Per decode step (call / new tokens), under the profiler (which slows the host: wall times here are "
             "longer than the `generate` table's). GPU: all kernel time; MLP GPU: kernel time inside the MLP "
             "modules' forwards; MLP host: CPU time inside them; GPU busy: GPU / wall (well below 1: the step "
             "waits on the host). MLP columns: dynamic cache only (hooks marking the MLPs would change a "
             "compiled forward).", "",
             "| cache | batch | mode | wall ms | GPU ms | MLP GPU ms (share of GPU) | MLP host ms (share of wall) "
             "| GPU busy |", "|---|---|---|---|---|---|---|---|"]
    for r in data["profile"]:
        for mode in ("eager", "patched"):
            p = r[mode]
            gpu, mlp_gpu, mlp_host = p["gpu_ms"], p["mlp_gpu_ms"], p["mlp_host_ms"]
            gpu_share = mlp_gpu / gpu if gpu and mlp_gpu is not None else None
            wall_share = mlp_host / p["wall_ms"] if mlp_host is not None else None
            lines.append(f"| {r['cache']} | {r['batch']} | {mode} | {p['wall_ms']:.2f} | {fmt(gpu, '.2f')} | "
                         f"{fmt(mlp_gpu, '.2f')} ({fmt(gpu_share, '.0%')}) | {fmt(mlp_host, '.2f')} "
                         f"({fmt(wall_share, '.0%')}) | {fmt(p['gpu_busy'], '.2f')} |")
    return lines + _families(data)


def step_bound(step_ms: float, gpu_saved_ms: float) -> float:
    """The highest patched / eager speedup of a step of step_ms (eager, unprofiled) when the patch
    takes gpu_saved_ms of GPU time off it and none of its host time (a step bound by GPU work
    would shorten by all of it; any host wait the GPU idles through is left as it is)."""
    return step_ms / (step_ms - gpu_saved_ms)


def _families(data: dict) -> list[str]:
    rows = [r for r in data["profile"] if r["eager"].get("family_gpu_ms")]
    if not rows:
        return []
    families = list(rows[0]["eager"]["family_gpu_ms"])
    step = {(g["cache"], g["batch"]): g["eager"]["median_s"] * 1e3 / g["new_tokens"] for g in data.get("generate", [])}
    lines = ["", "GPU time per decode step by kernel family (fused: ours; gemm: cuBLAS/CUTLASS; attention; triton: "
             "Inductor's and other Triton kernels). GPU saved = eager's GPU ms - patched's. Bound: the speedup "
             "of eager's unprofiled `generate` step (this run's `generate` part) if the patch took the saved GPU "
             "time off it and nothing else: what the step can gain at most when its host time does not shrink.", "",
             "| cache | batch | mode | " + " | ".join(f"{f} ms" for f in families) + " | host gap ms (wall - GPU) |",
             "|---|---|---|" + "---|" * (len(families) + 1)]
    bounds = []
    for r in rows:
        for mode in ("eager", "patched"):
            p = r[mode]
            lines.append(f"| {r['cache']} | {r['batch']} | {mode} | "
                         + " | ".join(f"{p['family_gpu_ms'][f]:.3f}" for f in families)
                         + f" | {p['wall_ms'] - p['gpu_ms']:.2f} |")
        saved = r["eager"]["gpu_ms"] - r["patched"]["gpu_ms"]
        key = (r["cache"], r["batch"])
        bound = f"{step_bound(step[key], saved):.3f}x" if key in step else "–"
        bounds.append(f"| {r['cache']} | {r['batch']} | {saved * 1e3:.0f} | {fmt(step.get(key), '.3f')} | {bound} |")
    return lines + ["", "| cache | batch | GPU saved µs per step | eager step ms (`generate`) | bound |",
                    "|---|---|---|---|---|"] + bounds


def _agreement(data: dict) -> list[str]:
    a = data["agreement"]
    lines = ["", "## Agreement of patched with eager", "",
             f"- logits on a {a['probe_tokens']}-token prompt: max |diff| {a['max_abs_logit_diff']:.3g}, relative "
             f"{a['rel_logit_diff']:.2e}, top-1 agreement {a['top1_agree']:.4f}"]
    if a["generate_leading_tokens"]:
        lines.append("- leading greedy tokens equal, eager vs patched `generate` (first sequence; a random-init "
                     "model's logits are near ties, so one 16-bit rounding difference ends the agreement): "
                     + ", ".join(f"{g['cache']} batch {g['batch']}: {g['equal']} of {g['of']}"
                                 for g in a["generate_leading_tokens"]))
    return lines + ["", "```", data["patch_report"], "```"]


def render_markdown(data: dict) -> str:
    """The whole report as markdown."""
    lines = _header(data)
    for key, part in (("prefill", lambda d: prefill_table(d["prefill"], "eager")), ("generate", _generate), ("graph", _graph), ("host", _host),
                      ("profile", _profile)):
        if data.get(key):
            lines += part(data)
    return "\n".join(lines + _agreement(data)) + "\n"


def summary_lines(data: dict) -> list[str]:
    """The speedups and host ratios, one line each, for the terminal."""
    out = [f"[bench_e2e] {data['model']['label']}, {data['model']['layers']} layers, "
           f"{data['env']['gpu'].get('name')}, commit {data['env']['git']['commit']}"]
    for r in data.get("prefill", []):
        out.append(f"  prefill {r['prompt']:6d}            patched/eager {r['speedup']['median']:.3f}x")
    for r in data.get("generate", []):
        s = r["speedup"]
        out.append(f"  generate {r['cache']:7s} batch {r['batch']:3d} patched/eager {s['median']:.3f}x "
                   f"({s['min']:.3f}-{s['max']:.3f}), {_verdict(s['median'], GENERATE_TARGETS[r['cache']], True)}")
    for r in data.get("graph", []):
        out.append(f"  graph decode batch {r['batch']:3d}    patched/eager {r['speedup']['median']:.3f}x")
    for r in data.get("host", []):
        out.append(f"  host per MLP call, batch {r['batch']:3d}: {r['eager']['median_us']:.1f} -> "
                   f"{r['patched']['median_us']:.1f} us ({r['patched_over_eager']:.3f}, "
                   f"{_verdict(r['patched_over_eager'], HOST_TARGET, False)})")
    return out
