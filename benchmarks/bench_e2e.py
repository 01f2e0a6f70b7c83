"""End to end on a real-shaped model, eager against patched (`apply_fused_mlp`): prefill, HF
`generate` with a dynamic and a static cache, decode in a CUDA graph, host time per MLP call.

    python -m benchmarks.bench_e2e --out OUT [--shape llama-3-8b | qwen2.5-7b] [--layers 8]
    python -m benchmarks.bench_e2e --out OUT --parts generate host --cache dynamic --batches 1 32
    python -m benchmarks.bench_e2e --render OUT/results.json      # markdown only, CPU
    python -m benchmarks.bench_e2e --dry-run --out /tmp/e2e        # tiny model on CPU, every part

The model is a random-init causal LM with the real dimensions of `--shape` (`harness/models.py`:
Llama-3-8B or Qwen2.5-7B) but, by default, 8 of its layers (`--layers`; the report says how
many), bf16, SDPA, built on the GPU and run under torch.inference_mode(). Two copies are built
from one seed and one is patched; every part times the two **in turns**, round by round, the
order reversed every other round, and reports the per-round ratios (median and spread): the
host's speed drifts by tens of percent between minutes, and a drift falls on both sides of a
ratio. The parts (`--parts`, default all):

- prefill: one forward of a [1, P] prompt with use_cache=True and logits_to_keep=1 (what
  `generate` runs for the prompt), P in `--prefill`; tokens/s = P / time; and the peak GPU memory
  each prefill allocates above the weights.
- generate: `model.generate`, greedy, min_new_tokens = max_new_tokens = `--new-tokens` (random
  weights would stop at EOS), on [B, `--prompt`] random prompts, for every batch B in `--batches`
  and cache in `--cache`: "dynamic" (the default DynamicCache: each step bound by the host's
  Python) and "static" (`cache_implementation="static"`: on CUDA transformers compiles the
  forward with torch.compile and CUDA graphs; the first call, which compiles, is not timed and
  is recorded). tokens/s = B x new / wall time of the call.
- graph: greedy decode with the step captured in a CUDA graph (`harness/decode_graph.py`: what a
  serving engine runs); tokens/s = B / (CUDA-event time per step). Uncaptured on CPU.
- host: host µs of one call of layer 0's MLP on x [B, 1, hidden] (a decode step's MLP call),
  started on an idle GPU (`harness/host_time.py`), eager `forward` against the patched one.
- profile: one `generate` call per (cache, batch, mode) under torch.profiler with each MLP's
  forward marked (`harness/step_profile.py`; with the dynamic cache only: hooks would change a
  compiled forward): per decode step, wall time, all GPU kernel time, the MLPs' GPU time, the
  host time inside the MLPs, and how busy the GPU was: where a step's time goes, and what the
  MLP is of it. On CUDA also GPU time by kernel family, for both caches, and (with the
  `generate` part in the same run) the most a step can gain from the GPU time the patch saves.
- agreement (always): patched against eager logits on a probe prompt, and how many leading greedy
  tokens the two `generate` runs share.

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .harness.cli import Parser, UsageError, guarded, read_json, require_cuda, write_json
from .harness.host_time import host_from_idle, in_turns, ratio_stats, synchronizer, us_stats
from .harness.models import MODELS, TINY, build_model, mlps
from .harness.report_e2e import SCHEMA, leading, render_markdown, summary_lines

PROG = "python -m benchmarks.bench_e2e"
PARTS = ("prefill", "generate", "graph", "host", "profile")
CACHES = ("dynamic", "static")
MODES = ("eager", "patched")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shape", choices=sorted(MODELS), default="llama-3-8b", help="the model's dimensions")
    p.add_argument("--layers", type=positive_int, help="decoder layers (default 8; the dry run 2)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default all)")
    p.add_argument("--cache", nargs="+", choices=CACHES, default=list(CACHES), help="generate: cache kinds")
    p.add_argument("--batches", type=positive_int, nargs="+", help="generate, graph, host: batch sizes (default 1 8 32)")
    p.add_argument("--prefill", type=positive_int, nargs="+", help="prefill: prompt lengths (default 4096 8192)")
    p.add_argument("--new-tokens", type=positive_int, help="tokens generated per call (default 128), >= 2")
    p.add_argument("--prompt", type=positive_int, help="prompt length of generate and graph (default 128)")
    p.add_argument("--rounds", type=positive_int, help="rounds eager and patched take turns in (default 5)")
    p.add_argument("--host-calls", type=positive_int, default=200, help="host: timed calls per MLP and batch")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, backend torch: checks every part")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if args.out is None and not args.render:
        p.error("--out is required: the folder for results.json and results.md")
    small = args.dry_run
    args.layers = args.layers or (2 if small else 8)
    args.batches = args.batches or ([1, 2] if small else [1, 8, 32])
    args.prefill = args.prefill or ([16, 32] if small else [4096, 8192])
    args.new_tokens = args.new_tokens or (4 if small else 128)
    args.prompt = args.prompt or (8 if small else 128)
    args.rounds = args.rounds or (2 if small else 5)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (a graph decode times new - 1 steps)")
    dims = (TINY if small else MODELS)[args.shape]
    if args.layers > dims.full_layers and not small:
        p.error(f"--layers {args.layers}: {dims.label} has {dims.full_layers}")
    args.parts = list(dict.fromkeys(args.parts))
    args.cache = list(dict.fromkeys(args.cache))
    return args


def _peak_extra_mib(device: torch.device, fn) -> float | None:
    """Peak GPU memory one call of fn allocates above what is allocated before it, MiB (None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _pair(times: dict[str, list[float]], work: float) -> dict:
    """Per mode the rounds' seconds and the median rate `work / s`; the per-round speedup
    patched / eager (= t_eager / t_patched: above 1 is faster patched)."""
    out = {mode: {"rounds_s": ts, "median_s": statistics.median(ts), "per_s": work / statistics.median(ts)}
           for mode, ts in times.items()}
    out["speedup"] = ratio_stats(times["eager"], times["patched"])
    return out


def measure_prefill(models: dict, args, device, vocab: int, gen: torch.Generator, sync) -> list[dict]:
    rows = []
    for p_len in args.prefill:
        ids = torch.randint(2, vocab, (1, p_len), generator=gen).to(device)
        fns = {mode: (lambda m=m: m(ids, use_cache=True, logits_to_keep=1)) for mode, m in models.items()}
        peaks = {mode: _peak_extra_mib(device, fn) for mode, fn in fns.items()}  # also the warm-up
        row = {"prompt": p_len, **_pair(in_turns(fns, args.rounds, sync), p_len)}
        for mode in models:
            row[mode]["peak_extra_mib"] = peaks[mode]
        rows.append(row)
        print(f"[bench_e2e] prefill {p_len}: patched/eager {row['speedup']['median']:.3f}x", flush=True)
    return rows


def _allow_static_recompiles() -> None:
    """With a static cache every (model, batch) compiles the same forward code object again;
    past dynamo's limit (8) it would silently run eager: raise the limit, and fail if it is hit."""
    config = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, knob):
            setattr(config, knob, max(getattr(config, knob), 64))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def generate_cases(args, device, vocab: int, gen: torch.Generator):
    """(cache, batch, call) for every cache kind and batch: call(model) runs greedy `generate`
    on [batch, prompt] random prompts with exactly `new_tokens` new tokens."""
    new = args.new_tokens
    if "static" in args.cache:
        _allow_static_recompiles()
    for cache in args.cache:
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        for batch in args.batches:
            ids = torch.randint(2, vocab, (batch, args.prompt), generator=gen).to(device)
            mask = torch.ones_like(ids)

            def call(model, ids=ids, mask=mask, extra=extra):
                return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, **extra)

            yield cache, batch, call


def measure_generate(models: dict, args, device, vocab: int, gen: torch.Generator, sync) -> list[dict]:
    """Every (cache, batch): one untimed call per mode (a static cache compiles there), then
    `rounds` rounds of one call per mode in turns."""
    new, rows = args.new_tokens, []
    for cache, batch, call in generate_cases(args, device, vocab, gen):
        first_s, tokens = {}, {}
        for mode, model in models.items():
            sync()
            t0 = time.perf_counter()
            out = call(model)
            sync()
            first_s[mode] = time.perf_counter() - t0
            tokens[mode] = out[:, args.prompt:].tolist()
            if out.shape[1] != args.prompt + new:
                raise RuntimeError(f"bench_e2e: generate made {out.shape[1] - args.prompt} tokens, not {new}")
        times = in_turns({mode: (lambda m=m: call(m)) for mode, m in models.items()}, args.rounds, sync)
        row = {"cache": cache, "batch": batch, "new_tokens": new, "prompt": args.prompt,
               "compiled": cache == "static" and device.type == "cuda", "first_call_s": first_s,
               **_pair(times, batch * new), "tokens": {mode: t[0] for mode, t in tokens.items()},
               "equal_leading": [leading(a, b) for a, b in zip(tokens["eager"], tokens["patched"])]}
        rows.append(row)
        s = row["speedup"]
        print(f"[bench_e2e] generate {cache:7s} batch {batch:3d}: eager {row['eager']['per_s']:9.1f} tok/s, "
              f"patched {row['patched']['per_s']:9.1f}, patched/eager {s['median']:.3f}x "
              f"({s['min']:.3f}-{s['max']:.3f})", flush=True)
    return rows


def measure_graph(models: dict, args, device, vocab: int, gen: torch.Generator) -> list[dict]:
    """Decode with the step captured in a CUDA graph (uncaptured on CPU), the modes in turns."""
    from .harness.decode_graph import GraphDecoder

    new, rows = args.new_tokens, []
    for batch in args.batches:
        ids = torch.randint(2, vocab, (batch, args.prompt), generator=gen).to(device)
        decoders = {mode: GraphDecoder(m, ids, new, capture=device.type == "cuda") for mode, m in models.items()}
        tokens = {mode: d.run()[0][0].tolist() for mode, d in decoders.items()}  # warm-up
        steps: dict[str, list[float]] = {mode: [] for mode in models}
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                steps[mode].append(decoders[mode].run()[1] / (new - 1))
        row = {"batch": batch, "new_tokens": new, **_pair(steps, batch), "tokens": tokens}
        rows.append(row)
        print(f"[bench_e2e] graph decode batch {batch:3d}: patched/eager {row['speedup']['median']:.3f}x", flush=True)
        del decoders
    return rows


def measure_host(models: dict, args, device, dims, sync) -> list[dict]:
    """Host µs of one call of layer 0's MLP from idle, x [B, 1, hidden], the modes in turns."""
    rows = []
    layer0 = {mode: mlps(m)[0] for mode, m in models.items()}
    dtype = next(layer0["eager"].parameters()).dtype
    for batch in args.batches:
        x = torch.randn(batch, 1, dims.hidden, device=device, dtype=dtype)
        samples = host_from_idle({mode: (lambda f=f: f(x)) for mode, f in layer0.items()}, args.host_calls,
                                 args.rounds, sync)
        row = {"batch": batch, **{mode: us_stats(s) for mode, s in samples.items()}}
        row["patched_over_eager"] = row["patched"]["median_us"] / row["eager"]["median_us"]
        rows.append(row)
        print(f"[bench_e2e] host per MLP call, batch {batch:3d}: eager {row['eager']['median_us']:.1f} us, "
              f"patched {row['patched']['median_us']:.1f} us ({row['patched_over_eager']:.2f}x)", flush=True)
    return rows


def _per_step(figures: dict, steps: int) -> dict:
    """Every millisecond figure of a profiled call (keys ending `_ms`, numbers or {name: ms}) / steps."""
    def per(v):
        return {k: x / steps for k, x in v.items()} if isinstance(v, dict) else v / steps
    return {k: (per(v) if k.endswith("_ms") and v is not None else v) for k, v in figures.items()}


def measure_profile(models: dict, args, device, vocab: int, gen: torch.Generator, sync, marked=mlps) -> list[dict]:
    """One profiled `generate` call per (cache, batch, mode), after the untimed calls of `generate`
    (or one here) compiled and warmed it; figures per decode step (/ new tokens). marked(model): the
    modules whose forwards the profile marks ("mlp" figures; with the dynamic cache only)."""
    from .harness.step_profile import profile_call

    new, rows = args.new_tokens, []
    for cache, batch, call in generate_cases(args, device, vocab, gen):
        row = {"cache": cache, "batch": batch, "new_tokens": new}
        for mode, model in models.items():
            call(model)  # warm (a static cache compiles on its first call)
            hooked = marked(model) if cache == "dynamic" else []  # hooks would recompile a compiled forward
            got = profile_call(lambda model=model: call(model), hooked, sync, device.type == "cuda")
            row[mode] = _per_step(got, new)
        rows.append(row)
        e, p = row["eager"], row["patched"]
        print(f"[bench_e2e] profile {cache:7s} batch {batch:3d}: ms/step eager {e['wall_ms']:.2f} "
              f"(GPU {e['gpu_ms'] or 0:.2f}, MLP GPU {e['mlp_gpu_ms'] or 0:.2f}), patched {p['wall_ms']:.2f} "
              f"(GPU {p['gpu_ms'] or 0:.2f}, MLP GPU {p['mlp_gpu_ms'] or 0:.2f})", flush=True)
    return rows


def run(args: argparse.Namespace) -> dict:
    from swiglu_patch import apply_fused_mlp

    if not args.dry_run:
        require_cuda(PROG)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dims = (TINY if args.dry_run else MODELS)[args.shape]
    dtype, backend = torch.bfloat16, ("torch" if args.dry_run else "auto")
    sync = synchronizer(device)
    t0 = time.perf_counter()
    models = {mode: build_model(dims, args.layers, device, dtype, args.seed) for mode in MODES}  # same weights
    build_s = time.perf_counter() - t0
    data = {
        "schema": SCHEMA, "kind": "bench_e2e", "env": environment(device, args.commit),
        "model": {"shape": dims.name, "label": dims.label, "model_type": dims.model_type, "hidden": dims.hidden,
                  "intermediate": dims.intermediate, "heads": dims.heads, "kv_heads": dims.kv_heads,
                  "vocab": dims.vocab, "layers": args.layers, "full_layers": dims.full_layers,
                  "dtype": str(dtype).removeprefix("torch."), "attn": "sdpa",
                  "params": sum(p.numel() for p in models["eager"].parameters()), "build_s": round(build_s, 1)},
        "settings": {"parts": args.parts, "rounds": args.rounds, "caches": args.cache, "batches": args.batches,
                     "prefill": args.prefill, "prompt": args.prompt, "new_tokens": args.new_tokens,
                     "host_calls": args.host_calls, "backend": backend, "dry_run": args.dry_run, "seed": args.seed,
                     "stat": "eager and patched in turns, order reversed every other round; wall time, device "
                             "synchronized; medians and per-round ratios"},
    }
    gen = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        report = apply_fused_mlp(models["patched"], backend=backend)
        data["patch_report"] = str(report)
        if len(report.patched) != args.layers:
            raise RuntimeError(f"bench_e2e: apply_fused_mlp patched {len(report.patched)} of {args.layers} MLPs:\n"
                               f"{report}")
        probe = torch.randint(2, dims.vocab, (1, min(512, max(args.prefill))), generator=gen).to(device)
        logits = {mode: m(probe).logits.float() for mode, m in models.items()}
        if "prefill" in args.parts:
            data["prefill"] = measure_prefill(models, args, device, dims.vocab, gen, sync)
        if "generate" in args.parts:
            data["generate"] = measure_generate(models, args, device, dims.vocab, gen, sync)
        if "graph" in args.parts:
            data["graph"] = measure_graph(models, args, device, dims.vocab, gen)
        if "host" in args.parts:
            data["host"] = measure_host(models, args, device, dims, sync)
        if "profile" in args.parts:
            data["profile"] = measure_profile(models, args, device, dims.vocab, gen, sync)
    data["agreement"] = agreement(logits, data.get("generate", []))
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    return data


def agreement(logits: dict[str, torch.Tensor], generate_rows: list[dict]) -> dict:
    """Patched against eager: logits [1, P, vocab] (fp32) on one probe prompt, and per `generate`
    row how many leading greedy tokens the first sequence shares and the fewest any sequence shares."""
    diff = logits["patched"] - logits["eager"]
    return {
        "probe_tokens": logits["eager"].shape[1],
        "max_abs_logit_diff": diff.abs().max().item(),
        "rel_logit_diff": (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(logits["eager"])).item(),
        "top1_agree": (logits["patched"].argmax(-1) == logits["eager"].argmax(-1)).float().mean().item(),
        "generate_leading_tokens": [
            {"cache": g["cache"], "batch": g["batch"], "equal": leading(g["tokens"]["eager"], g["tokens"]["patched"]),
             "fewest_equal": min(g["equal_leading"]), "of": g["new_tokens"]} for g in generate_rows],
    }


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.render:
        data = read_json(args.render)
        if data.get("kind") != "bench_e2e" or data.get("schema") != SCHEMA:
            raise UsageError(f"{args.render}: not a bench_e2e results JSON of schema {SCHEMA} (found kind "
                             f"{data.get('kind')!r}, schema {data.get('schema')!r}); its results.md was rendered "
                             "by the commit that wrote it")
        out = args.out or args.render.parent
    else:
        out = args.out
        data = run(args)
        print(f"[bench_e2e] wrote {write_json(data, out / 'results.json')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(render_markdown(data))
    print("\n".join(summary_lines(data)))
    print(f"[bench_e2e] wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
