"""End to end on real-shaped MoE models: transformers' default experts path against the fused
experts (`apply_fused_mlp`, which switches every experts module to "swiglu_patch").

    python -m benchmarks.bench_e2e_moe --out OUT [--models qwen3-30b-a3b:8 gpt-oss-20b qwen3-30b-a3b]
    python -m benchmarks.bench_e2e_moe --out OUT --models qwen3-30b-a3b --static-batches 1 --rounds 3
    python -m benchmarks.bench_e2e_moe --render OUT/qwen3-30b-a3b-8l/results.json   # markdown only, CPU
    python -m benchmarks.bench_e2e_moe --dry-run --out /tmp/e2e_moe                  # tiny models, CPU, fp32

Each `--models` entry is NAME or NAME:LAYERS (default: the model's full depth): a random-init
causal LM from transformers' own config class with the real sizes (`MOE_MODELS`, no hub),
built on the GPU in bf16 (about 61 GB for all 48 layers of Qwen3-30B-A3B, 42 GB for
gpt-oss-20b with bf16 experts, not MXFP4). One copy of the weights serves both modes: the
patched model is a copy of the module tree that shares every parameter and buffer but has its
own config, which is where transformers reads the experts implementation. In the JSON the
modes are "eager" (the unpatched model: transformers' default, grouped_mm, which `generate`
switches to batched_mm for its decode steps) and "patched". The parts, `bench_e2e`'s, the modes
in turns round by round, the order reversed every other round:

- prefill: one forward of [1, P] with use_cache=True, logits_to_keep=1, P in `--prefill`;
- generate: greedy `generate`, `--new-tokens` forced, on [B, `--prompt`] random prompts, B in
  `--batches` with the dynamic cache and in `--static-batches` with `cache_implementation="static"`
  (transformers compiles the forward, mode "reduce-overhead": CUDA graphs). Before the static
  rows, a capture check per (batch, mode): the first (compiling) call's seconds, dynamo's graph
  breaks and Inductor's skipped CUDA graphs counted over it, and the CUDA graph replays of the
  next call (about one per decode step when the step is captured, none when it is not);
- profile: one `generate` call per (cache, batch in `--profile-batches` and in that cache's
  batches, mode) and one prefill forward per length and mode under torch.profiler: GPU time by
  kernel family, the experts modules' GPU and host time (where hooks can mark their forwards:
  not in a compiled one) and the host gap (wall - GPU);
- agreement (always): logits on a probe prompt, the fraction of routing decisions (a layer's
  top-k set for a token) that differ, how unevenly the default routes that prompt (the busiest
  expert's pairs over the mean, per layer), and per `generate` row the first position where a
  sequence's greedy tokens differ;
- watch (every prefill and generate row, `harness/step_watch.py`, no profiler): per mode the
  host time of each prompt and decode-step forward, of the experts modules within a step and of
  `generate`'s loop between steps, the
  caching allocator's retries and peak reserved memory, the garbage collector's collections and
  time, and the device's free memory; with the rates of each round, what tells host time,
  allocator pressure, collector pauses and run-to-run noise apart.

Order per model: prefill, then generate and profile with the dynamic cache, then with the static
cache (whose compilation takes the longest; the capture check compiles the patched model first
and saves each mode as it is done). Writes OUT/<name>-<L>l/results.json (GPU, versions, commit: `swiglu_patch.provenance`), rewritten
after every part so that a run cut short keeps what it measured, and results.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from . import bench_e2e
from .harness.cli import Parser, UsageError, guarded, read_json, require_cuda, write_json
from .harness.host_time import synchronizer
from .harness.report_e2e_moe import SCHEMA, render_markdown, summary_lines
from .harness.step_watch import StepWatch

PROG = "python -m benchmarks.bench_e2e_moe"
PARTS = ("prefill", "generate", "profile")


@dataclass(frozen=True)
class MoEModel:
    """One MoE model's shape as transformers' config class takes it.

    Attributes:
        name: key on the command line.
        label: what the reports call it.
        model_type: transformers' model_type (`AutoConfig.for_model`).
        full_layers: the real model's decoder layers.
        attn: attention implementation (gpt-oss has no SDPA path in transformers: "eager").
        config: the config.json fields of the real model that differ from the class's defaults.
    """

    name: str
    label: str
    model_type: str
    full_layers: int
    attn: str
    config: dict


MOE_MODELS: dict[str, MoEModel] = {
    "qwen3-30b-a3b": MoEModel("qwen3-30b-a3b", "Qwen3-30B-A3B", "qwen3_moe", 48, "sdpa", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)),
    "gpt-oss-20b": MoEModel("gpt-oss-20b", "gpt-oss-20b", "gpt_oss", 24, "eager", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, tie_word_embeddings=False,
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)),
}

# --dry-run: the same classes at hidden 64, fp32 on CPU in seconds.
_TINY_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=1)
TINY: dict[str, MoEModel] = {
    "qwen3-30b-a3b": MoEModel("qwen3-30b-a3b", "tiny qwen3_moe (dry run)", "qwen3_moe", 2, "sdpa",
                              MOE_MODELS["qwen3-30b-a3b"].config | _TINY_SIZES | dict(moe_intermediate_size=48,
                                                                                      num_experts=8)),
    "gpt-oss-20b": MoEModel("gpt-oss-20b", "tiny gpt_oss (dry run)", "gpt_oss", 2, "eager",
                            MOE_MODELS["gpt-oss-20b"].config | _TINY_SIZES | dict(intermediate_size=48,
                                                                                  num_local_experts=8, sliding_window=8)),
}


def _model_entry(text: str) -> tuple[str, int | None]:
    name, _, layers = text.partition(":")
    if name not in MOE_MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {name!r}; choose from {', '.join(sorted(MOE_MODELS))}, "
                                         "optionally with :LAYERS (qwen3-30b-a3b:8)")
    return name, (positive_int(layers) if layers else None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--models", type=_model_entry, nargs="+", metavar="NAME[:LAYERS]",
                   help="models in order (default qwen3-30b-a3b:8 gpt-oss-20b qwen3-30b-a3b; dry run both at 2)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default all)")
    p.add_argument("--prefill", type=positive_int, nargs="+", help="prefill: prompt lengths (default 2048 4096)")
    p.add_argument("--batches", type=positive_int, nargs="*", help="generate, dynamic cache (default 1 8 32)")
    p.add_argument("--static-batches", type=positive_int, nargs="*", help="generate, static cache (default 1 8 32)")
    p.add_argument("--profile-batches", type=positive_int, nargs="*", help="profile, both caches (default 1 32)")
    p.add_argument("--new-tokens", type=positive_int, help="tokens generated per call (default 32), >= 2")
    p.add_argument("--prompt", type=positive_int, help="prompt length of generate (default 64)")
    p.add_argument("--rounds", type=positive_int, help="rounds the modes take turns in (default 5)")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny models on CPU, fp32, backend torch: checks every part")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if args.out is None and not args.render:
        p.error("--out is required: the folder of the per-model results folders")
    small = args.dry_run
    default_models = [("qwen3-30b-a3b", 2), ("gpt-oss-20b", 2)] if small else \
        [("qwen3-30b-a3b", 8), ("gpt-oss-20b", None), ("qwen3-30b-a3b", None)]
    args.models = args.models or default_models
    args.prefill = args.prefill or ([16] if small else [2048, 4096])
    args.batches = [1, 2] if small and args.batches is None else ([1, 8, 32] if args.batches is None else args.batches)
    if args.static_batches is None:
        args.static_batches = [1] if small else [1, 8, 32]
    if args.profile_batches is None:
        args.profile_batches = [1] if small else [1, 32]
    args.new_tokens = args.new_tokens or (3 if small else 32)
    args.prompt = args.prompt or (8 if small else 64)
    args.rounds = args.rounds or (2 if small else 5)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (a decode step follows the prompt)")
    table = TINY if small else MOE_MODELS
    for name, layers in args.models:
        if layers is not None and layers > table[name].full_layers and not small:
            p.error(f"--models {name}:{layers}: {table[name].label} has {table[name].full_layers} layers")
    args.parts = list(dict.fromkeys(args.parts))
    return args


def build_model(spec: MoEModel, layers: int, device: torch.device, dtype: torch.dtype, seed: int):
    """Random-init causal LM of `spec` with `layers` decoder layers, allocated and initialised on
    `device` in `dtype` (no CPU copy), in eval mode with requires_grad off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.model_type, num_hidden_layers=layers, **spec.config)
    config._attn_implementation = spec.attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree and config that shares every parameter and buffer with it."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every experts module (transformers' `@use_experts_implementation` classes) of `model`."""
    from swiglu_patch.experts import is_experts_class

    return [m for m in model.modules() if is_experts_class(m)]


def routed_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [1, P, vocab] in fp32 of one forward, and each experts module's top_k_index [P, top_k]."""
    picks: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: picks.append(args[1].clone()))
             for m in experts_modules(model)]
    try:
        logits = model(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, picks


def routing_differs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Fraction of (layer, token) routing decisions whose top-k expert sets differ."""
    rows = [(x.sort(-1).values != y.sort(-1).values).any(-1) for x, y in zip(a, b)]
    return torch.cat(rows).float().mean().item()


def routing_load(picks: list[torch.Tensor], config) -> dict:
    """How unevenly the default's routing spreads a prompt's pairs: per layer, the busiest
    expert's pairs over the mean per expert (1: even; E / top_k at most), and the experts used."""
    experts = config.num_local_experts
    loads = [torch.bincount(p.reshape(-1).long(), minlength=experts)[:experts].float() for p in picks]
    busiest = [(c.max() / c.mean()).item() for c in loads]
    return {"busiest_over_mean": busiest, "experts_used": [int((c > 0).sum()) for c in loads],
            "pairs_per_layer": int(picks[0].numel()) if picks else 0}


def _counters() -> tuple[dict, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"]), counters["inductor"]["cudagraph_skips"]


class _GraphReplays:
    """Counts `torch.cuda.CUDAGraph.replay` calls (Inductor's CUDA graph trees replay through it) while open."""

    def __enter__(self):
        self.count, self._replay = 0, torch.cuda.CUDAGraph.replay

        def replay(graph, *a, **k):
            self.count += 1
            return self._replay(graph, *a, **k)

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self._replay


def capture_check(models: dict, args, device, vocab: int, gen: torch.Generator, sync, rows: list[dict],
                  save: Callable[[], None]) -> None:
    """Per static batch and mode: the first `generate` call (it compiles) timed, with the graph
    breaks and skipped CUDA graphs it added, then the CUDA graph replays of a second call; each
    mode's figures appended to `rows` and `save()` called as soon as they are known. The patched
    model compiles first: its compile is the shorter (no grouped_mm), so a run cut by a time
    limit while the default compiles keeps it."""
    for _cache, batch, call in bench_e2e.generate_cases(args, device, vocab, gen):
        row = {"batch": batch}
        rows.append(row)
        for mode in sorted(models, key=lambda m: m != "patched"):
            model = models[mode]
            print(f"[bench_e2e_moe] static batch {batch}: compiling {mode} ({time.strftime('%H:%M:%S')})", flush=True)
            breaks0, skips0 = _counters()
            sync()
            t0 = time.perf_counter()
            call(model)
            sync()
            first_s = time.perf_counter() - t0
            breaks1, skips1 = _counters()
            with _GraphReplays() as replays:
                call(model)
                sync()
            row[mode] = {"first_call_s": first_s, "cudagraph_skips": skips1 - skips0, "graph_replays": replays.count,
                         "graph_breaks": {k: v - breaks0.get(k, 0) for k, v in breaks1.items()
                                          if v != breaks0.get(k, 0)}}
            save()
            print(f"[bench_e2e_moe] static batch {batch}: {mode} first call {first_s:.1f} s, {replays.count} graph "
                  f"replays, {sum(row[mode]['graph_breaks'].values())} graph breaks, "
                  f"{row[mode]['cudagraph_skips']} cudagraph skips", flush=True)


def profile_prefill(models: dict, args, device, vocab: int, gen: torch.Generator, sync) -> list[dict]:
    """One profiled prefill forward per prompt length and mode (after a warm-up call), the experts marked."""
    from .harness.step_profile import profile_call

    rows = []
    for p_len in args.prefill:
        ids = torch.randint(2, vocab, (1, p_len), generator=gen).to(device)
        row = {"prompt": p_len}
        for mode, model in models.items():
            model(ids, use_cache=True, logits_to_keep=1)
            row[mode] = profile_call(lambda model=model: model(ids, use_cache=True, logits_to_keep=1),
                                     experts_modules(model), sync, device.type == "cuda")
        rows.append(row)
    return rows


def _narrow(args, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def run_model(args, name: str, layers: int | None, out: Path) -> dict:
    """Every part on one model; results.json under `out` rewritten after each part."""
    from swiglu_patch import apply_fused_mlp

    spec = (TINY if args.dry_run else MOE_MODELS)[name]
    layers = layers or spec.full_layers
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype, backend = (torch.float32, "torch") if args.dry_run else (torch.bfloat16, "auto")
    sync = synchronizer(device)
    t0 = time.perf_counter()
    base = build_model(spec, layers, device, dtype, args.seed)
    models = {"eager": base, "patched": sharing_copy(base)}
    sync()
    build_s = time.perf_counter() - t0
    cfg = base.config
    data = {
        "schema": SCHEMA, "kind": "bench_e2e_moe", "env": environment(device, args.commit),
        "model": {"shape": name, "label": spec.label, "model_type": spec.model_type, "layers": layers,
                  "full_layers": spec.full_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
                  "experts": cfg.num_local_experts, "top_k": cfg.num_experts_per_tok,
                  "expert_intermediate": getattr(cfg, "moe_intermediate_size", cfg.intermediate_size),
                  "dtype": str(dtype).removeprefix("torch."), "attn": spec.attn,
                  "default_experts": cfg._experts_implementation,
                  "params": sum(p.numel() for p in base.parameters()), "build_s": round(build_s, 1)},
        "settings": {"parts": args.parts, "rounds": args.rounds, "batches": args.batches,
                     "static_batches": args.static_batches, "profile_batches": args.profile_batches,
                     "prefill": args.prefill, "prompt": args.prompt, "new_tokens": args.new_tokens,
                     "backend": backend, "dry_run": args.dry_run, "seed": args.seed,
                     "stat": "default and patched in turns, order reversed every other round; wall time, device "
                             "synchronized; medians and per-round ratios"},
    }
    path = out / "results.json"
    gen = torch.Generator().manual_seed(args.seed)
    vocab = cfg.vocab_size
    with torch.inference_mode():
        report = apply_fused_mlp(models["patched"], backend=backend)
        data["patch_report"] = str(report)
        switched = len(experts_modules(models["patched"]))
        if switched != layers or not all(getattr(m.config, "_experts_implementation", None) == "swiglu_patch"
                                         for m in experts_modules(models["patched"])):
            raise RuntimeError(f"bench_e2e_moe: apply_fused_mlp did not switch all {layers} experts modules:\n{report}")
        if base.config._experts_implementation == "swiglu_patch":
            raise RuntimeError("bench_e2e_moe: patching the sharing copy switched the original's config too")
        probe = torch.randint(2, vocab, (1, min(512, max(args.prefill))), generator=gen).to(device)
        logits, routes = zip(*(routed_logits(m, probe) for m in models.values()))
        logits = dict(zip(models, logits))
        data["agreement"] = bench_e2e.agreement(logits, []) | {"routing_differs": routing_differs(*routes),
                                                               "routing_load": routing_load(routes[0], cfg)}
        del routes
        write_json(data, path)  # a run cut short keeps the agreement of logits and routing
        if "prefill" in args.parts:
            data["prefill"] = []
            for p_len in args.prefill:
                with StepWatch(models, device.type == "cuda") as watch:
                    (row,) = bench_e2e.measure_prefill(models, _narrow(args, prefill=[p_len]), device, vocab, gen,
                                                       sync)
                data["prefill"].append(row | {"watch": watch.summary()})
                write_json(data, path)
        if "profile" in args.parts:
            data["prefill_profile"] = profile_prefill(models, args, device, vocab, gen, sync)
            write_json(data, path)
        for cache in ("dynamic", "static"):  # the dynamic cache's rows first: a static cache compiles for minutes
            batches = args.batches if cache == "dynamic" else args.static_batches
            if "generate" in args.parts and batches:
                narrow = _narrow(args, cache=[cache], batches=batches)
                if cache == "static":
                    data["capture"] = []
                    capture_check(models, narrow, device, vocab, gen, sync, data["capture"],
                                  lambda: write_json(data, path))
                for batch in batches:  # one row at a time, each watched
                    with StepWatch(models, device.type == "cuda", hooks=cache == "dynamic",
                                   marked=experts_modules) as watch:
                        (row,) = bench_e2e.measure_generate(models, _narrow(narrow, batches=[batch]), device, vocab,
                                                            gen, sync)
                    data["generate"] = data.get("generate", []) + [row | {"watch": watch.summary()}]
                    write_json(data, path)
            profiled = [b for b in args.profile_batches if b in batches]
            if "profile" in args.parts and profiled:
                narrow = _narrow(args, cache=[cache], batches=profiled)
                rows = bench_e2e.measure_profile(models, narrow, device, vocab, gen, sync, marked=experts_modules)
                data["profile"] = data.get("profile", []) + rows
                write_json(data, path)
    data["agreement"] |= bench_e2e.agreement(logits, data.get("generate", []))
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(data, path)
    return data


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _write_report(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(render_markdown(data))
    print("\n".join(summary_lines(data)))
    print(f"[bench_e2e_moe] wrote {out / 'results.md'}", flush=True)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.render:
        data = read_json(args.render)
        if data.get("kind") != "bench_e2e_moe" or data.get("schema") != SCHEMA:
            raise UsageError(f"{args.render}: not a bench_e2e_moe results JSON of schema {SCHEMA} (found kind "
                             f"{data.get('kind')!r}, schema {data.get('schema')!r})")
        _write_report(data, args.out or args.render.parent)
        return 0
    if not args.dry_run:
        require_cuda(PROG)
    for name, layers in args.models:
        spec = (TINY if args.dry_run else MOE_MODELS)[name]
        out = args.out / f"{name}-{layers or spec.full_layers}l"
        print(f"[bench_e2e_moe] {spec.label}, {layers or spec.full_layers} layers -> {out}", flush=True)
        data = run_model(args, name, layers, out)
        _write_report(data, out)
        del data
        torch._dynamo.reset()  # compiled forwards hold the model: free its weights before the next one
        gc.collect()
        if not args.dry_run:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
