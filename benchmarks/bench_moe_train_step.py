"""A whole training step of a few-layer MoE model with AdamW: transformers' grouped_mm against the fused experts.

    python -m benchmarks.bench_moe_train_step --out OUT [--layers 4] [--seq 4096] [--lora 16]
    python -m benchmarks.bench_moe_train_step --dry-run --out /tmp/moe_step      # CPU, tiny model, fp32
    python -m benchmarks.bench_moe_train_step --render OUT/results.json          # markdown only

A step: the model's own loss on [batch, seq] random tokens (labels = inputs), backward, AdamW
(lr 1e-5, torch's default implementation), zero_grad. The model: `--model`'s shape from
`bench_e2e_moe.MOE_MODELS` (Qwen3-30B-A3B: hidden 2048, 128 experts of I = 768, top-8,
vocabulary 151936) with `--layers` decoder layers, random init from one seed, bf16 weights,
built on the GPU, so every way starts from the same weights and sees the same batches.

Ways (`--ways`):
- grouped_mm: transformers' default experts implementation (`config._experts_implementation`);
- store, recompute: `apply_fused_mlp` (every experts module on the fused kernels) and
  `set_experts_mode` (what the experts' backward keeps: the pairs' [T*k, 2I] pre-activation, or x).

With `--lora R`: PEFT LoRA (rank R, alpha 2R, dropout 0), the base frozen, on attention's
q/k/v/o (`target_modules`) and on the experts' 3-D weights (`target_parameters`
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``); `get_peft_model` after patching.
Which LoRA path ran is recorded per way from its first step: the calls of PEFT's
`ParamWrapper.get_delta_weight` and `get_delta_factors` (each builds a full E x out x in weight
or delta), how many experts calls saw a parametrized (materialized W + s*B@A) weight, and how
many had the adapter bound for the fused kernels to add inside the grouped GEMMs (no delta).

Each way builds its model fresh, runs `--warmup` steps, then `--steps` timed steps (host clock
around a synchronized step); the ways take turns over `--rounds` rounds, order reversed every
other round. Reported: ms/step and tokens/s (median over rounds of each round's median), the
peak GPU memory of the way's first round (weights, gradients, AdamW states, activations) and
the memory allocated before the first step (the static part), the peak of one more untimed
forward + backward above the weights and optimizer states (AdamW's temporaries set the whole
step's peak in full training, the same for every way), the losses of round 0 against
grouped_mm's (same weights and batches: within atol 1e-2 + rtol 5e-2, the convergence
tolerance), and for --lora the targets: time <= 0.6x and peak <= 0.7x grouped_mm's.

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) after every way's
round, so a run cut by a time limit keeps what it measured, and OUT/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from swiglu_patch.inputs import nonnegative_int, positive_int
from swiglu_patch.provenance import environment

from .bench_e2e_moe import MOE_MODELS, TINY, build_model, experts_modules
from .bench_train_step import LOSS_ATOL, LOSS_RTOL, batches
from .harness.cli import Parser, guarded, render_or_run, require_cuda, write_json

PROG = "python -m benchmarks.bench_moe_train_step"
SCHEMA = 1
WAYS = ("grouped_mm", "store", "recompute")
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA_TARGETS = {"time_over_grouped_mm": 0.6, "peak_over_grouped_mm": 0.7}  # the issue's LoRA step targets
MIB = 2**20
LORA_BOUND = "_swiglu_lora"  # on an experts module while swiglu_patch.experts_lora binds an adapter to it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--model", choices=sorted(MOE_MODELS), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=positive_int, help="decoder layers (default 4; the dry run 2)")
    p.add_argument("--seq", type=positive_int, help="tokens per sequence (default 4096; the dry run 32)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps per way and round")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per way and round")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--lora", type=nonnegative_int, default=0, metavar="R",
                   help="train PEFT LoRA adapters of rank R on attention and the experts, base frozen (0: full)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no round after this many seconds (0: none)")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, backend torch, fp32")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render RESULTS_JSON)")
    args.layers = args.layers or (2 if args.dry_run else 4)
    args.seq = args.seq or (32 if args.dry_run else 4096)
    if args.model != "qwen3-30b-a3b" and args.lora:
        p.error(f"--lora targets Qwen3-MoE's module names; run it with --model qwen3-30b-a3b, not {args.model}")
    return args


def lora_config(rank: int):
    """PEFT's LoraConfig of the LoRA step: attention's projections and the experts' 3-D weights."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_MODULES,
                      target_parameters=LORA_PARAMETERS)


def build_way(way: str, args, device, dtype) -> torch.nn.Module:
    """A fresh model for one way (same seed, so the same weights for every way), trainable as the mode says."""
    from swiglu_patch import apply_fused_mlp
    from swiglu_patch.experts import set_experts_mode

    spec = (TINY if args.dry_run else MOE_MODELS)[args.model]
    model = build_model(spec, args.layers, device, dtype, args.seed).train().requires_grad_(True)
    experts = experts_modules(model)
    if way == "grouped_mm":
        model.config._experts_implementation = "grouped_mm"
    else:
        with warnings.catch_warnings():  # "build the optimizer after patching": run_way does
            warnings.simplefilter("ignore", UserWarning)
            apply_fused_mlp(model, backend="torch" if args.dry_run else "auto")
        if set_experts_mode(model, way) != len(experts):
            raise RuntimeError(f"apply_fused_mlp switched {set_experts_mode(model, way)} of {len(experts)} experts "
                               "modules; the step would not measure the fused experts")
    if args.lora:
        from peft import get_peft_model

        torch.manual_seed(args.seed + 1)  # the same adapters for every way
        model = get_peft_model(model, lora_config(args.lora))
    return model


@contextlib.contextmanager
def lora_path_counter(model: torch.nn.Module):
    """Count, while open, what PEFT builds for LoRA on the experts and what the experts calls read.

    Yields a dict: "delta_weight_calls" and "delta_factors_calls" (PEFT's `ParamWrapper` methods
    that build a full delta or the factors of W + s*B@A), "experts_calls", and
    "experts_calls_parametrized" (calls whose module held a parametrized, materialized weight),
    "experts_calls_lora_in_kernels" (calls with an adapter bound for the fused kernels to add inside
    their GEMMs: `swiglu_patch.experts_lora`, where it is installed),
    "experts_implementation" (the implementations transformers was set to run, in call order).
    """
    from torch.nn.utils import parametrize

    counts = {"delta_weight_calls": 0, "delta_factors_calls": 0, "experts_calls": 0, "experts_calls_parametrized": 0,
              "experts_calls_lora_in_kernels": 0, "experts_implementation": []}
    patched = []
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        ParamWrapper = None
    if ParamWrapper is not None:
        for name, key in (("get_delta_weight", "delta_weight_calls"), ("get_delta_factors", "delta_factors_calls")):
            original = ParamWrapper.__dict__.get(name)
            if original is None:
                continue

            def counted(self, *a, _f=original, _k=key, **kw):
                counts[_k] += 1
                return _f(self, *a, **kw)
            setattr(ParamWrapper, name, counted)
            patched.append((name, original))

    def hook(module, _inputs):
        counts["experts_calls"] += 1
        counts["experts_calls_parametrized"] += int(parametrize.is_parametrized(module))
        counts["experts_calls_lora_in_kernels"] += int(bool(module.__dict__.get(LORA_BOUND)))
        impl = getattr(module.config, "_experts_implementation", None)
        if impl not in counts["experts_implementation"]:
            counts["experts_implementation"].append(impl)
    handles = [m.register_forward_pre_hook(hook) for m in experts_modules(model)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
        for name, original in patched:
            setattr(ParamWrapper, name, original)


def run_way(way: str, args, device, dtype, data: list[torch.Tensor], sync) -> dict:
    """Build, warm up and time one way: {"step_s", "losses", "peak_mib", "static_mib", "fwd_bwd_mib", "lora_path",
    "trainable_params"}; fwd_bwd_mib: the peak of one more forward + backward above the weights and the optimizer's
    states (activations and gradients), which the whole step's peak (AdamW's temporaries) can hide."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_way(way, args, device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    static = torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else None
    losses, times, path = [], [], None
    for n, ids in enumerate(data):
        ids = ids.to(device)
        sync()
        t0 = time.perf_counter()
        with lora_path_counter(model) if n == 0 else contextlib.nullcontext() as counts:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if n == 0:
            path = counts
        if n >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float().item())
    peak = fwd_bwd = None
    if device.type == "cuda":  # one more forward + backward, untimed, from weights and optimizer states alone
        peak = torch.cuda.max_memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        ids = data[0].to(device)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        sync()
        fwd_bwd = (torch.cuda.max_memory_allocated(device) - start) / MIB
        opt.zero_grad(set_to_none=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": times, "losses": losses, "peak_mib": peak, "static_mib": static, "fwd_bwd_mib": fwd_bwd,
            "lora_path": path, "trainable_params": trainable}


def compare(results: dict, lora: bool) -> None:
    """Against grouped_mm, in place: time and peak ratios, loss agreement, and --lora's targets."""
    base = results.get("grouped_mm")
    for way, e in results.items():
        e["step_s"] = statistics.median(e["rounds_step_s"])
        if base is None or way == "grouped_mm":
            continue
        base_s = statistics.median(base["rounds_step_s"])
        e["time_over_grouped_mm"] = e["step_s"] / base_s
        if e["peak_mib"] is not None and base["peak_mib"]:
            e["peak_over_grouped_mm"] = e["peak_mib"] / base["peak_mib"]
        if e.get("fwd_bwd_mib") is not None and base.get("fwd_bwd_mib"):
            e["fwd_bwd_over_grouped_mm"] = e["fwd_bwd_mib"] / base["fwd_bwd_mib"]
        pairs = list(zip(e["losses"], base["losses"]))
        e["max_loss_diff"] = max(abs(a - b) for a, b in pairs)
        e["losses_within_tolerance"] = all(abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b) for a, b in pairs)
        if lora:
            e["targets"] = {f"{k} <= {v}": (None if k not in e else e[k] <= v) for k, v in LORA_TARGETS.items()}


def run(args: argparse.Namespace) -> dict:
    if not args.dry_run:
        require_cuda(PROG)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    spec = (TINY if args.dry_run else MOE_MODELS)[args.model]
    data = batches(args, spec.config["vocab_size"], 0, args.warmup + args.steps)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    out = {"schema": SCHEMA, "kind": "bench_moe_train_step", "env": environment(device, args.commit),
           "model": {"shape": args.model, "label": spec.label, "layers": args.layers,
                     "dtype": str(dtype).removeprefix("torch."),
                     **{k: spec.config[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                    "num_experts_per_tok", "vocab_size") if k in spec.config}},
           "settings": {"seq": args.seq, "batch": args.batch, "lora_rank": args.lora,
                        "lora_target_modules": LORA_MODULES if args.lora else None,
                        "lora_target_parameters": LORA_PARAMETERS if args.lora else None,
                        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                        "optimizer": "AdamW(lr=1e-5)", "dry_run": args.dry_run,
                        "tokens_per_step": args.batch * args.seq,
                        "stat": "median over rounds of each round's median step time; ways in turns, order reversed "
                                "every other round; peak memory, static memory and losses of round 0"},
           "results": results}
    for r in range(args.rounds):
        if r and args.budget_s and time.perf_counter() - t0 > args.budget_s:
            print(f"[bench_moe_train_step] --budget-s {args.budget_s:g} spent: no round {r}", flush=True)
            break
        for way in (args.ways if r % 2 == 0 else args.ways[::-1]):
            print(f"[bench_moe_train_step] round {r} {way}: building, {args.warmup} + {args.steps} steps", flush=True)
            got = run_way(way, args, device, dtype, data, sync)
            entry = results.setdefault(way, {"way": way, "rounds_step_s": [], "losses": got["losses"],
                                             "peak_mib": got["peak_mib"], "static_mib": got["static_mib"],
                                             "fwd_bwd_mib": got["fwd_bwd_mib"],
                                             "trainable_params": got["trainable_params"],
                                             "lora_path": got["lora_path"]})
            entry["rounds_step_s"].append(statistics.median(got["step_s"]))
            compare(results, bool(args.lora))
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            write_json(out, args.out / "results.json")  # a run cut by its time limit keeps what it measured
            peak = "-" if got["peak_mib"] is None else f"{got['peak_mib']:.0f}"
            print(f"[bench_moe_train_step] round {r} {way:10s} {entry['rounds_step_s'][-1] * 1e3:8.1f} ms/step, "
                  f"peak {peak} MiB, loss {got['losses'][0]:.4f}, lora path {got['lora_path']}", flush=True)
    return out


def render_markdown(data: dict) -> str:
    m, s, env = data["model"], data["settings"], data["env"]
    gpu, v = env.get("gpu") or {}, env.get("versions", {})
    lines = [f"# Training step: {m['label']} shape, {m['layers']} layers, transformers' grouped_mm against the fused "
             "experts", "",
             f"- {m['dtype']}, seq {s['seq']}, batch {s['batch']}; {s['optimizer']}; E = {m.get('num_experts')}, "
             f"top-{m.get('num_experts_per_tok')}, K = {m.get('hidden_size')}, I = {m.get('moe_intermediate_size')}, "
             f"vocabulary {m.get('vocab_size')}",
             *([f"- PEFT LoRA r={s['lora_rank']} (alpha 2r, dropout 0) on {', '.join(s['lora_target_modules'])} and "
                f"{', '.join(s['lora_target_parameters'])}; base frozen"] if s.get("lora_rank") else []),
             f"- GPU: {gpu.get('name', 'none (dry run on CPU)')}; torch {v.get('torch')}, triton {v.get('triton')}, "
             f"transformers {v.get('transformers')}, peft {v.get('peft')}",
             f"- commit {env['git']['commit']}; measured {env.get('date_utc')}",
             f"- {s['warmup']} untimed + {s['steps']} timed steps per way and round, {s['rounds']} rounds; {s['stat']}",
             "- peak: the way's first round, whole steps; static: allocated before the first step; fwd+bwd: the peak of "
             "one more forward + backward above the weights and optimizer states (activations and gradients)",
             "", "| way | ms / step | tokens/s | time / grouped_mm | peak MiB | static MiB | peak / grouped_mm | "
             "fwd+bwd MiB | fwd+bwd / grouped_mm | losses vs grouped_mm (max abs diff) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(x, spec):
        return "–" if x is None else format(x, spec)
    for way, e in data["results"].items():
        agree = ("–" if "losses_within_tolerance" not in e else
                 f"{'within' if e['losses_within_tolerance'] else '**outside**'} tolerance ({e['max_loss_diff']:.2e})")
        step = e.get("step_s") or statistics.median(e["rounds_step_s"])
        lines.append(f"| {way} | {step * 1e3:.1f} | {s['tokens_per_step'] / step:.0f} | "
                     f"{f(e.get('time_over_grouped_mm'), '.3f')} | {f(e['peak_mib'], '.0f')} | "
                     f"{f(e['static_mib'], '.0f')} | {f(e.get('peak_over_grouped_mm'), '.3f')} | "
                     f"{f(e.get('fwd_bwd_mib'), '.0f')} | {f(e.get('fwd_bwd_over_grouped_mm'), '.3f')} | {agree} |")
    if s.get("lora_rank"):
        lines += ["", "Which LoRA path ran (first step; PEFT's ParamWrapper calls, experts calls on a parametrized "
                  "weight):", ""]
        lines += [f"- {way}: {e['lora_path']}" for way, e in data["results"].items()]
        lines += ["", "| way | target | met |", "|---|---|---|"]
        lines += [f"| {way} | {t} | {'–' if ok is None else 'yes' if ok else 'NO'} |"
                  for way, e in data["results"].items() for t, ok in e.get("targets", {}).items()]
    lines += ["", "Losses of round 0 per step:", ""]
    lines += [f"- {way}: " + ", ".join(f"{x:.5f}" for x in e["losses"]) for way, e in data["results"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    return render_or_run(parse_args(argv), "bench_moe_train_step", SCHEMA, run, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
