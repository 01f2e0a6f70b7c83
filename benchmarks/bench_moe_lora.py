"""LoRA on one MoE experts block (forward + backward): the adapters inside our grouped GEMMs against PEFT's delta.

    python -m benchmarks.bench_moe_lora --out OUT [--shapes qwen3-30b-a3b] [--tokens 4096 16384] [--rank 16]
    python -m benchmarks.bench_moe_lora --dry-run --out /tmp/moe_lora   # CPU, tiny, fp32
    python -m benchmarks.bench_moe_lora --render OUT/results.json                         # markdown only

The experts module of a real model's shape as transformers builds it (`bench_moe.build_experts`,
bf16, uniform routing), frozen, with PEFT's LoRA (`target_parameters` on gate_up_proj and
down_proj, rank --rank, alpha 2r, random A and B) injected by `peft.inject_adapter_in_model`;
x, the routing weights and the four adapter weights require gradients. Ways, on the same module,
inputs and dOut:

- ours_fused: our experts implementation with the adapters inside the grouped GEMMs
  (`swiglu_patch.experts_lora`, op ``swiglu_patch::experts_lora_train``, store mode);
- peft_grouped_mm: transformers' grouped_mm under PEFT's parametrization (W + s*B@A built every forward);
- peft_on_ours: our fused experts reading PEFT's materialized weight (`experts_lora.materialize`).

Each way's first step counts PEFT's parametrizations (`deltas_built`: 0 for ours_fused, 2 per
forward for the others), so the table shows which path ran.

Per way and row: fwd+bwd ms (CUDA events, median: `harness.timing.EventTimer`), saved MiB
(allocated after the forward, less the output), peak MiB above the start, and each gradient's
relative error against float64 autograd of `experts_reference` with the same adapters. Writes
OUT/results.json (GPU, versions, commit) after every way and OUT/results.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .bench_moe import MOE_SHAPES, TINY, MoEShape, build_experts, routing
from .harness.cli import Parser, guarded, render_or_run, require_device, write_json
from .harness.fwd_bwd import grad_errors, memory_of, step_fn

PROG = "python -m benchmarks.bench_moe_lora"
SCHEMA = 1
WAYS = ("ours_fused", "peft_grouped_mm", "peft_on_ours")
GRADS = ("x", "top_k_weights", "gate_up_proj.lora_A", "gate_up_proj.lora_B", "down_proj.lora_A", "down_proj.lora_B")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in MOE_SHAPES], default=["qwen3-30b-a3b"])
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[4096, 16384])
    p.add_argument("--rank", type=positive_int, default=16)
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--reps", type=positive_int, default=10, help="timed calls per way in each of 3 rounds")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shape, fp32, Triton interpreter, no timing")
    p.add_argument("--render", type=Path, help="rebuild results.md from this results.json and exit")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render a results.json)")
    return args


def with_lora(shape: MoEShape, device, dtype, rank: int, seed: int):
    """(container whose `.experts` is PEFT-wrapped, the bare experts module, {grad name: adapter weight})."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper

    container = torch.nn.Module()
    container.experts = build_experts(shape, device, dtype, seed).requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    inject_adapter_in_model(config, container)
    gen = torch.Generator().manual_seed(seed + 1)
    adapters = {}
    for wrapper in (m for m in container.modules() if isinstance(m, ParamWrapper)):
        for part in ("A", "B"):
            weight = getattr(wrapper, f"lora_{part}")["default"].weight
            fan_in = weight.shape[1] if part == "A" else rank
            with torch.no_grad():
                weight.copy_(torch.randn(weight.shape, generator=gen) * fan_in ** -0.5)
            adapters[f"{wrapper.parameter_name}.lora_{part}"] = weight.requires_grad_()
    return container, container.experts.get_base_layer(), adapters


def way_fn(name: str, container, experts, x, idx, w):
    """One forward of way `name` (PEFT's wrapper, then the experts implementation the way names)."""
    from swiglu_patch import experts_lora
    from swiglu_patch.experts import IMPLEMENTATION, register_implementation

    register_implementation()
    impl = "grouped_mm" if name == "peft_grouped_mm" else IMPLEMENTATION

    def call():
        experts.config._experts_implementation = impl
        experts.__dict__["_swiglu_backend"] = "triton"  # the kernels (the interpreter in a dry run)
        experts.__dict__["_swiglu_experts_mode"] = "store"
        experts_lora.materialize(experts, name == "peft_on_ours")
        return container.experts(x, idx, w)
    return call


def reference_grads(experts, leaves: dict, idx, dout, rank: int) -> dict:
    """Every leaf's gradient by float64 autograd of `experts_reference` with the adapters unmaterialized."""
    from swiglu_patch.experts import experts_spec
    from swiglu_patch.kernels.experts_reference import ExpertsLowRank, experts_reference

    spec = experts_spec(experts)
    e = experts.gate_up_proj.shape[0]
    ref = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}

    def factors(name):
        a, b = ref[f"{name}.lora_A"], ref[f"{name}.lora_B"]
        return a.view(e, rank, a.shape[1]), b.view(b.shape[0], rank, e).permute(2, 0, 1), 2.0

    low_rank = ExpertsLowRank(*factors("gate_up_proj"), *factors("down_proj"))
    out = experts_reference(ref["x"], idx, ref["top_k_weights"], experts.gate_up_proj.double(),
                            experts.down_proj.double(), spec.epilogue, spec.layout, low_rank=low_rank)
    out.backward(dout.double())
    return {k: v.grad for k, v in ref.items()}


def deltas_built(step) -> int:
    """Run `step` once; how many times PEFT parametrized a weight with its W + s*B@A (0: never materialized)."""
    from torch.nn.utils import parametrize

    register, count = parametrize.register_parametrization, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return register(*args, **kwargs)

    parametrize.register_parametrization = counted
    try:
        step()
    finally:
        parametrize.register_parametrization = register
    return count[0]


def run(args: argparse.Namespace) -> dict:
    from .harness.timing import EventTimer

    dry = args.dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    shapes = [TINY] if dry else [s for s in MOE_SHAPES if s.name in args.shapes]
    rank = 4 if dry else args.rank
    timer = None if dry else EventTimer(cuda=True, reps=args.reps, rounds=3, warmup=2)
    rows = []
    data = {"kind": "moe_lora", "schema": SCHEMA, "environment": environment(device, args.commit),
            "dtype": str(dtype), "rank": rank, "timer": None if dry else timer.describe(), "rows": rows,
            "shapes": {s.name: vars(s) for s in shapes}}
    t0 = time.perf_counter()

    def flush() -> None:
        data["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(data, args.out / "results.json")

    for shape in shapes:
        container, experts, adapters = with_lora(shape, device, dtype, rank, args.seed)
        for tokens in ([5, 37] if dry else args.tokens):
            idx, w = routing(shape, tokens, "uniform", device, args.seed)
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, shape.k, generator=gen).to(device, dtype).requires_grad_()
            w = w.requires_grad_()
            dout = (torch.randn(tokens, shape.k, generator=gen) * shape.k ** -0.5).to(device, dtype)
            leaves = {"x": x, "top_k_weights": w, **adapters}
            ref = reference_grads(experts, leaves, idx, dout, rank)
            row = {"shape": shape.name, "tokens": tokens, "ways": {}}
            rows.append(row)
            steps = {}
            for name in args.ways:
                fn = way_fn(name, container, experts, x, idx, w)
                step = step_fn(fn, leaves, dout)
                print(f"  [moe_lora] {shape.name} T={tokens}: {name}: first call, errors, memory", flush=True)
                try:
                    built = deltas_built(step)
                    errors = grad_errors(leaves, ref)
                    row["ways"][name] = {"errors": errors, "max_error": max(errors.values()),
                                         "deltas_built": built, **memory_of(fn, leaves, dout)}
                    steps[name] = step
                except torch.OutOfMemoryError as e:
                    row["ways"][name] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
                    torch.cuda.empty_cache()
                flush()
            if timer is not None and steps:
                for name, seconds in timer.many(steps).items():
                    row["ways"][name]["ms"] = seconds * 1e3
            flush()
            print(_line(row), flush=True)
    return data


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(row: dict) -> str:
    return f"{row['shape']} T={row['tokens']}: " + " | ".join(
        f"{k}: {v['error']}" if "error" in v else f"{k}: {_fmt(v.get('ms'), '.2f')} ms saved "
        f"{_fmt(v.get('saved_mib'), '.0f')} peak {_fmt(v.get('peak_mib'), '.0f')} MiB err {v['max_error']:.1e}"
        for k, v in row["ways"].items())


def render_markdown(data: dict) -> str:
    env = data["environment"]
    gpu, versions = env.get("gpu") or {}, env.get("versions") or {}
    lines = ["# LoRA on one MoE experts block (forward + backward)", "",
             f"GPU: {gpu.get('name')}; torch {versions.get('torch')}, triton {versions.get('triton')}, transformers "
             f"{versions.get('transformers')}, peft {versions.get('peft')}; {data['dtype']}; rank {data['rank']}; "
             f"commit {(env.get('git') or {}).get('commit')}.", f"Timer: {data.get('timer')}.", "",
             "saved: MiB allocated after the forward, less the output. peak: MiB above the start during forward + "
             "backward. err: relative error of each gradient against float64 autograd of the reference.", "",
             "| shape | T | way | deltas built | fwd+bwd ms | vs ours | saved MiB | peak MiB | " + " | ".join(
                 f"err d{g}" for g in GRADS) + " |", "|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(GRADS)]
    for r in data["rows"]:
        ours = r["ways"].get("ours_fused", {}).get("ms")
        for name, v in r["ways"].items():
            if "error" in v:
                lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {v['error']} |" + " |" * (6 + len(GRADS)))
                continue
            ratio = None if ours is None or v.get("ms") is None else v["ms"] / ours
            lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {v.get('deltas_built')} | {_fmt(v.get('ms'), '.2f')} | "
                         f"{_fmt(ratio, '.2f')}x | {_fmt(v.get('saved_mib'), '.0f')} | {_fmt(v.get('peak_mib'), '.0f')}"
                         " | " + " | ".join(_fmt(v["errors"].get(g), ".1e") for g in GRADS) + " |")
    return "\n".join(lines) + "\n"


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if not args.render:
        require_device(PROG, args.dry_run)
    return render_or_run(args, "moe_lora", SCHEMA, run, render_markdown)


def main(argv: list[str] | None = None) -> int:
    """The command line; a problem with the arguments or the machine is one line and exit code 2."""
    return guarded(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
