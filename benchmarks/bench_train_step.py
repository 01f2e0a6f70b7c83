"""A whole training step of a real-shaped model, eager against patched (store, recompute) and Liger.

    python -m benchmarks.bench_train_step --out OUT [--layers 4] [--seq 4096] [--batch 1]
    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_train_step --fsdp2 --out OUT
    python -m benchmarks.bench_train_step --dry-run --out /tmp/step         # CPU, tiny model
    python -m benchmarks.bench_train_step --render OUT/results.json        # markdown only

A step: the model's own loss on [batch, seq] random tokens (labels = inputs), backward, AdamW
(lr 1e-5, torch's default implementation), zero_grad. The model is a random-init Llama-3-8B
shape (`harness/models.py`) with `--layers` decoder layers, bf16 weights, SDPA, built on the GPU
from one seed, so every way starts from the same weights and sees the same batches.

Ways (`--ways`), each with and without gradient checkpointing (`--checkpointing`, non-reentrant):
- eager: the model as transformers builds it;
- store, recompute: `apply_fused_mlp`, each fused MLP's `mode` set (what backward saves);
- liger: `liger_kernel.transformers.apply_liger_kernel_to_llama(swiglu=True)` on the instance,
  and nothing else of Liger (RoPE, RMSNorm, cross entropy off), so the comparison is the MLP's.

With `--lora R`: PEFT LoRA adapters (rank R, alpha 2R, dropout 0) on every projection of
attention and MLP (`LORA_TARGETS`), the base frozen: `get_peft_model` on the way's model (for
store and recompute after patching, through `swiglu_patch.lora.register`).

Each (way, checkpointing) builds its model fresh, runs `--warmup` steps, then `--steps` timed
steps; the ways take turns over `--rounds` rounds, order reversed every other round. Reported:
tokens/s (batch x seq x ranks / median step time), the peak GPU memory of the way's first round
(weights, gradients, AdamW states and activations; per rank under FSDP2), and the loss of
every step of the first round against eager's (same weights, same batches: equal within the
convergence tolerance, atol 1e-2 and rtol 5e-2, is the check), and the SM clock and board
power while each way ran its timed steps of the first round (`harness/gpu_clock.py`: at the
power cap a step's time follows its energy).

With `--fsdp2` (under torchrun; NCCL on GPUs, gloo with --dry-run): the model is patched first,
then every decoder layer and the model are sharded with `torch.distributed.fsdp.fully_shard`;
each rank takes its own batch, tokens/s counts all ranks'. Liger is not run under FSDP2.

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) and OUT/results.md
(rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from swiglu_patch.inputs import nonnegative_int, positive_int
from swiglu_patch.provenance import environment

from .harness.cli import Parser, guarded, render_or_run, require_cuda
from .harness.gpu_clock import ClockSampler, describe
from .harness.models import MODELS, TINY, build_model, mlps

PROG = "python -m benchmarks.bench_train_step"
SCHEMA = 1
WAYS = ("eager", "store", "recompute", "liger")
STEP_TARGET = 0.95  # the store mode's step time over eager's that the training issue asks for
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_ATOL, LOSS_RTOL = 1e-2, 5e-2  # the convergence tolerance (tests/training_stack/convergence.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--layers", type=positive_int, help="decoder layers (default 4; the dry run 2)")
    p.add_argument("--seq", type=positive_int, help="tokens per sequence (default 4096; the dry run 32)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step (per rank under --fsdp2)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--checkpointing", nargs="+", choices=("off", "on"), default=["off", "on"])
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps per way and round")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per way and round")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 (run under torchrun)")
    p.add_argument("--lora", type=nonnegative_int, default=0, metavar="R",
                   help="train PEFT LoRA adapters of rank R on every projection, base frozen (0: full training)")
    p.add_argument("--budget-s", type=float, default=360.0, help="start no round after this many seconds (0: none)")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, backend torch, fp32")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render RESULTS_JSON)")
    args.layers = args.layers or (2 if args.dry_run else 4)
    args.seq = args.seq or (32 if args.dry_run else 4096)
    if args.fsdp2 and "WORLD_SIZE" not in os.environ and not args.render:
        p.error("--fsdp2 runs under torchrun: torchrun --standalone --nproc-per-node N -m benchmarks.bench_train_step "
                "--fsdp2 ...")
    if args.fsdp2 and args.lora:
        p.error("--lora is not run under --fsdp2; drop one of them")
    if args.fsdp2:
        args.ways = [w for w in args.ways if w != "liger"]
    return args


def _liger_or_reason():
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as e:
        return None, f"liger_kernel not importable ({e})"
    return apply_liger_kernel_to_llama, None


def build_way(way: str, args, device, dtype, checkpointing: bool):
    """A fresh model for one way: same seed, so the same weights for every way."""
    from swiglu_patch import apply_fused_mlp

    dims = (TINY if args.dry_run else MODELS)["llama-3-8b"]
    model = build_model(dims, args.layers, device, dtype, args.seed).train().requires_grad_(True)
    if way in ("store", "recompute"):
        with warnings.catch_warnings():  # "build the optimizer after patching": run_way does
            warnings.simplefilter("ignore", UserWarning)
            apply_fused_mlp(model, backend="torch" if args.dry_run else "auto")
        for m in mlps(model):
            m.mode = way
    elif way == "liger":
        apply_liger, reason = _liger_or_reason()
        if apply_liger is None:
            raise RuntimeError(reason)
        from transformers.models.llama import modeling_llama

        classes = dict(vars(modeling_llama))
        try:
            apply_liger(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=False,
                        swiglu=True, model=model)
        finally:  # Liger also swaps modeling_llama's classes, which every later model would be built from
            for name, value in classes.items():
                setattr(modeling_llama, name, value)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model

        from swiglu_patch.lora import register

        config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules=LORA_TARGETS)
        torch.manual_seed(args.seed + 1)  # the same adapters for every way
        model = get_peft_model(model, register(config) if way in ("store", "recompute") else config)
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def batches(args, vocab: int, rank: int, count: int) -> list[torch.Tensor]:
    """[batch, seq] token ids per step, the same for every way; each rank its own."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return [torch.randint(2, vocab, (args.batch, args.seq), generator=gen) for _ in range(count)]


def run_way(way: str, checkpointing: bool, args, device, dtype, data: list[torch.Tensor], sync) -> dict:
    """Build, warm up and time one way; {"step_s": [...], "losses": [...], "peak_mib", "clock"} (clock:
    `gpu_clock.summarize` of the timed steps, None on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_way(way, args, device, dtype, checkpointing)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    losses, times, clock = [], [], None
    with contextlib.ExitStack() as timed:
        for n, ids in enumerate(data):
            if n == args.warmup and device.type == "cuda":  # the clock while the timed steps run
                clock = timed.enter_context(ClockSampler(device.index or 0))
            ids = ids.to(device)
            sync()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if n >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(_global_mean(loss.detach(), args.fsdp2))
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": times, "losses": losses, "peak_mib": peak, "clock": clock.summary() if clock else None}


def _global_mean(loss: torch.Tensor, distributed: bool) -> float:
    if not distributed:
        return loss.float().item()
    import torch.distributed as dist

    total = loss.float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _gather(value, distributed: bool) -> list:
    if not distributed:
        return [value]
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def run(args: argparse.Namespace) -> dict:
    distributed = args.fsdp2
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo" if args.dry_run else "nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        if not args.dry_run:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        rank, world = 0, 1
    if not args.dry_run:
        require_cuda(PROG)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dims = (TINY if args.dry_run else MODELS)["llama-3-8b"]
    skipped = {}
    ways = list(args.ways)
    if "liger" in ways:
        _, reason = _liger_or_reason()
        if reason is None and args.dry_run:
            reason = "Liger's kernels need a GPU"
        if reason is not None:
            skipped["liger"] = reason
            ways.remove("liger")
    runs = [(w, c == "on") for c in args.checkpointing for w in ways]
    data = batches(args, dims.vocab, rank, args.warmup + args.steps)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        if r and args.budget_s and time.perf_counter() - t0 > args.budget_s:
            break
        for way, ckpt in (runs if r % 2 == 0 else runs[::-1]):
            key = f"{way}{' +ckpt' if ckpt else ''}"
            got = run_way(way, ckpt, args, device, dtype, data, sync)
            entry = results.setdefault(key, {"way": way, "checkpointing": ckpt, "rounds_step_s": [],
                                             "losses": got["losses"], "peak_mib_per_rank": _gather(got["peak_mib"],
                                                                                                    distributed),
                                             "clock": got["clock"]})
            entry["rounds_step_s"].append(statistics.median(got["step_s"]))
            if rank == 0:
                print(f"[bench_train_step] round {r} {key:16s} {entry['rounds_step_s'][-1] * 1e3:8.1f} ms/step, "
                      f"loss {got['losses'][0]:.4f}", flush=True)
    tokens = args.batch * args.seq * world
    for key, e in results.items():
        e["step_s"] = statistics.median(e["rounds_step_s"])
        e["tokens_per_s"] = tokens / e["step_s"]
        base = results.get(f"eager{' +ckpt' if e['checkpointing'] else ''}")
        if base is not None:
            e["time_over_eager"] = e["step_s"] / base["step_s"]
            diffs = [abs(a - b) for a, b in zip(e["losses"], base["losses"])]
            e["max_loss_diff"] = max(diffs)
            e["losses_within_tolerance"] = all(abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b)
                                               for a, b in zip(e["losses"], base["losses"]))
    out = {
        "schema": SCHEMA, "kind": "bench_train_step", "env": environment(device, args.commit),
        "model": {"shape": dims.name, "label": dims.label, "layers": args.layers, "hidden": dims.hidden,
                  "intermediate": dims.intermediate, "vocab": dims.vocab, "dtype": str(dtype).removeprefix("torch.")},
        "settings": {"seq": args.seq, "batch": args.batch, "ranks": world, "fsdp2": args.fsdp2, "lora_rank": args.lora,
                     "lora_targets": LORA_TARGETS if args.lora else None, "warmup": args.warmup,
                     "steps": args.steps, "rounds": args.rounds, "optimizer": "AdamW(lr=1e-5)",
                     "dry_run": args.dry_run, "tokens_per_step": tokens,
                     "stat": "median over rounds of each round's median step time; ways in turns, order reversed "
                             "every other round; peak memory and losses of round 0"},
        "skipped": skipped, "results": results, "wall_s": round(time.perf_counter() - t0, 1),
    }
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    return out if rank == 0 else {}


def render_markdown(data: dict) -> str:
    m, s, env = data["model"], data["settings"], data["env"]
    gpu = env.get("gpu") or {}
    v = env.get("versions", {})
    lines = [f"# Training step: {m['label']} shape, {m['layers']} layers, eager against patched",
             "",
             f"- {m['dtype']}, seq {s['seq']}, batch {s['batch']} per rank, {s['ranks']} rank(s)"
             f"{', FSDP2 (every layer and the model fully_shard-ed)' if s['fsdp2'] else ''}; {s['optimizer']}",
             *([f"- PEFT LoRA r={s['lora_rank']} (alpha 2r, dropout 0) on {', '.join(s['lora_targets'])}; base frozen"]
               if s.get("lora_rank") else []),
             f"- GPU: {gpu.get('name', 'none (dry run on CPU)')}; torch {v.get('torch')}, triton {v.get('triton')}, "
             f"transformers {v.get('transformers')}, liger-kernel {v.get('liger-kernel')}",
             f"- commit {env['git']['commit']}; measured {env.get('date_utc')}",
             f"- {s['warmup']} untimed + {s['steps']} timed steps per way and round, {s['rounds']} rounds; "
             f"{s['stat']}",
             "",
             "| way | checkpointing | ms / step | tokens/s | time / eager | peak MiB per rank | losses vs eager "
             "(max abs diff) |", "|---|---|---|---|---|---|---|"]
    for key, e in data["results"].items():
        peaks = " / ".join("–" if p is None else f"{p:.0f}" for p in e["peak_mib_per_rank"])
        ratio = f"{e['time_over_eager']:.3f}x" if "time_over_eager" in e else "–"
        agree = ("–" if "losses_within_tolerance" not in e else
                 f"{'within' if e['losses_within_tolerance'] else '**outside**'} tolerance ({e['max_loss_diff']:.2e})")
        lines.append(f"| {e['way']} | {'on' if e['checkpointing'] else 'off'} | {e['step_s'] * 1e3:.1f} | "
                     f"{e['tokens_per_s']:.0f} | {ratio} | {peaks} | {agree} |")
    for way, reason in data["skipped"].items():
        lines.append(f"\n{way}: not run ({reason})")
    verdicts = [f"- {'MET' if e['time_over_eager'] <= STEP_TARGET else 'MISSED'}: store, checkpointing "
                f"{'on' if e['checkpointing'] else 'off'}: {e['time_over_eager']:.3f}x eager's step time "
                f"(target <= {STEP_TARGET}x)" for e in data["results"].values()
                if e["way"] == "store" and "time_over_eager" in e]
    if verdicts:
        lines += ["", *verdicts]
    clocks = [f"{key} {describe(e['clock']).removeprefix('GPU while timed: ')}" for key, e in data["results"].items()
              if describe(e.get("clock"))]
    if clocks:
        lines += ["", "GPU while each way ran its timed steps of round 0 (rank 0; `harness/gpu_clock.py`):", "",
                  *[f"- {c}" for c in clocks]]
    lines += ["", "Losses of round 0 per step:", ""]
    for key, e in data["results"].items():
        lines.append(f"- {key}: " + ", ".join(f"{x:.5f}" for x in e["losses"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    return render_or_run(parse_args(argv), "bench_train_step", SCHEMA, run, render_markdown)

if __name__ == "__main__":
    sys.exit(main())
