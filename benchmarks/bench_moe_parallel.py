"""An MoE model across GPUs under transformers' TP plan and its expert-parallel plan, the default
experts against the fused ones.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_moe_parallel --out OUT --commit C [--layers 48]
    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_moe_parallel --dry-run --out /tmp/mp   # CPU, gloo
    python -m benchmarks.bench_moe_parallel --render OUT/results.json

A random-init model with Qwen3-30B-A3B's dimensions (`bench_e2e_moe.MOE_MODELS`; `--layers`,
default all 48, about 61 GB in bf16) is saved once by rank 0 (`--model-dir`, kept for a later
run) and loaded by every rank under each plan of `--plans`:

- tp: `tp_plan="auto"`: attention colwise/rowwise, every expert's gate_up columns and down rows
  split over the ranks (`packed_colwise`/`rowwise`), each rank's partial block output all-reduced;
- ep: the model's expert-parallel plan: whole experts per rank (E / ranks, `Shard(0)`), a token's
  routes to another rank's experts masked (or, where the plan sends tokens, sent), the partial
  outputs summed. transformers 5.21+ takes `DistributedConfig(tp_size=N, ep_size=N)` (the dense
  modules keep the TP plan); earlier ones `enable_expert_parallel=True` (the EP plan replaces the
  TP plan: attention replicated). `distributed_config` picks by the installed API and the JSON
  records which.

Per plan, first `--check-layers` (default 8) of the checkpoint, loaded under the plan: logits on
a 512-token probe prompt, default and patched, against one GPU's default logits (rank 0 alone,
the same layers; its patched logits give the one-GPU rounding difference). Then the whole
checkpoint under the plan, one loaded model switched by `apply_fused_mlp` / `unpatch` (which
switch the experts' implementation and leave the sharded weights alone), the modes in turns,
`--rounds` rounds, the order reversed every other round, each item once per mode untimed first:

- prefill: one forward of [1, P] (use_cache, logits_to_keep=1), P in `--prefill`; tokens/s and
  the peak memory above the model per rank;
- generate: greedy with the dynamic cache, `--new-tokens` forced, [B, `--prompt`] prompts, B in
  `--batches`; tokens/s and the leading greedy tokens the two modes share.

`--budget-s` stops a plan's timed rounds (after the first) once the run has taken that long.
Rank 0 writes OUT/results.json (GPU, versions, commit) and OUT/results.md after every plan.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .bench_e2e_moe import MOE_MODELS, TINY, build_model
from .harness.cli import Parser, guarded, write_json
from .harness.ranks import (Timer, finish, gather, init_ranks, item_call, item_inputs, paired_row, require_torchrun,
                            rows_table)

PROG = "python -m benchmarks.bench_moe_parallel"
SCHEMA = 1
MODES = ("eager", "patched")
PLANS = ("tp", "ep")
MODEL = "qwen3-30b-a3b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS), help="in order (default tp ep)")
    p.add_argument("--layers", type=positive_int, help="decoder layers timed (default 48; the dry run 2)")
    p.add_argument("--check-layers", type=int, help="layers of the agreement check on one GPU (default 8, the dry "
                   "run 1; 0 skips it)")
    p.add_argument("--model-dir", type=Path, help="where rank 0 saves the random-init checkpoint (default /tmp/...)")
    p.add_argument("--prefill", type=positive_int, nargs="*", help="prompt lengths (default 2048)")
    p.add_argument("--batches", type=positive_int, nargs="*", help="generate batch sizes (default 1 32)")
    p.add_argument("--prompt", type=positive_int, help="generate prompt length (default 128)")
    p.add_argument("--new-tokens", type=positive_int, help="tokens generated per call (default 32)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--budget-s", type=positive_int, help="no timed round after the first past this many seconds")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, gloo, fp32, backend torch")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if args.render:
        return args
    if args.out is None:
        p.error("--out is required (or --render RESULTS_JSON)")
    require_torchrun(p, PROG)
    small = args.dry_run
    args.layers = args.layers or (2 if small else MOE_MODELS[MODEL].full_layers)
    args.check_layers = (1 if small else 8) if args.check_layers is None else args.check_layers
    if not 0 <= args.check_layers <= args.layers:
        p.error(f"--check-layers must be between 0 and --layers ({args.layers}), got {args.check_layers}")
    args.prefill = [16] if small and args.prefill is None else ([2048] if args.prefill is None else args.prefill)
    args.batches = [1, 2] if small and args.batches is None else ([1, 32] if args.batches is None else args.batches)
    args.prompt = args.prompt or (8 if small else 128)
    args.new_tokens = args.new_tokens or (4 if small else 32)
    args.model_dir = args.model_dir or Path(f"/tmp/bench_moe_parallel_{'tiny' if small else MODEL}_{args.layers}l")
    return args


def distributed_config(plan: str, world: int):
    """transformers' `DistributedConfig` for `plan` ("tp" or "ep") over `world` ranks, and a note of what it is."""
    from transformers import DistributedConfig

    if plan == "tp":
        return DistributedConfig(tp_plan="auto"), 'DistributedConfig(tp_plan="auto")'
    if "ep_size" in DistributedConfig.__dataclass_fields__:  # transformers 5.21+
        return (DistributedConfig(tp_size=world, ep_size=world),
                f"DistributedConfig(tp_size={world}, ep_size={world}): experts by expert, the dense modules TP")
    return (DistributedConfig(tp_size=world, enable_expert_parallel=True),
            f"DistributedConfig(tp_size={world}, enable_expert_parallel=True): experts by expert, the dense "
            "modules replicated")


def _checkpoint(args, spec, dtype, device, rank: int) -> None:
    """Rank 0 saves the random-init model once, built on `device` and saved from the CPU; every
    rank waits for it. transformers' save_pretrained converts the 3-D experts back to the
    checkpoint's per-expert tensors with a copy of each on its device, which does not fit next
    to all 48 layers (61 GB) on an 80 GB GPU."""
    import torch.distributed as dist

    done = args.model_dir / ".complete"
    if rank == 0 and not done.exists():
        model = build_model(spec, args.layers, device, dtype, args.seed).to("cpu")
        _free()
        model.save_pretrained(args.model_dir, max_shard_size="4GB")
        del model
        done.touch()
        _free()
    dist.barrier()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load(path: Path, dtype, plan: str | None, world: int, layers: int, full_layers: int):
    """The checkpoint's first `layers` layers under `plan` (None: whole on this process's device)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    extra = {} if layers == full_layers else {"num_hidden_layers": layers}  # the other layers' keys go unused
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if plan is None:
                return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).eval()
            config, _ = distributed_config(plan, world)
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config, **extra).eval()
    finally:
        logging.set_verbosity(verbosity)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _layout(model) -> dict:
    """Where one layer's expert and attention weights live under the loaded plan."""
    experts = model.model.layers[0].mlp.experts
    q = model.model.layers[0].self_attn.q_proj.weight

    def where(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        return {"type": type(t).__name__, "placements": [repr(p) for p in getattr(t, "placements", ())],
                "local_shape": list(local.shape)}

    return {"experts_gate_up": where(experts.gate_up_proj), "attention_q": where(q),
            "experts_default": experts.config._experts_implementation}


def plan_logits(args, plan: str, probe, backend: str, world: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The `--check-layers` model under `plan`: its default and patched logits on `probe` (fp32)."""
    from swiglu_patch import apply_fused_mlp, unpatch

    model = _load(args.model_dir, dtype, plan, world, args.check_layers, args.layers)
    with torch.inference_mode():
        plain = model(probe).logits.float()
        apply_fused_mlp(model, backend=backend)
        patched = model(probe).logits.float()
        unpatch(model)
    del model
    _free()
    return plain, patched


def agreement(single: dict, plain: torch.Tensor, patched: torch.Tensor, layers: int, dtype: torch.dtype) -> dict:
    """A plan's default and patched logits against one GPU's default (`single["eager"]`). The
    patched logits agree when their relative error is at most twice the larger of two reference
    differences (the plan's default against one GPU; one GPU patched against its default) plus
    one rounding step of the model's dtype (bf16: 2^-8)."""
    ref, one = single["eager"], single["patched"]
    bound = 2 * max(_rel(plain, ref), _rel(one, ref)) + torch.finfo(dtype).eps / 2
    return {"layers": layers, "probe_tokens": ref.shape[1],
            "one_gpu_patched_vs_eager": {"rel": _rel(one, ref), "top1": _top1(one, ref)},
            "plan_default_vs_one_gpu": {"rel": _rel(plain, ref), "top1": _top1(plain, ref)},
            "plan_patched_vs_one_gpu": {"rel": _rel(patched, ref), "top1": _top1(patched, ref)},
            "plan_patched_vs_plan_default": {"rel": _rel(patched, plain), "top1": _top1(patched, plain)},
            "bound": bound, "agrees": _rel(patched, ref) <= bound}


def _single_gpu(args, probe, backend: str, dtype, device, rank: int) -> dict:
    """Rank 0 alone: the `--check-layers` model on its device, default and patched logits on `probe`."""
    import torch.distributed as dist

    from swiglu_patch import apply_fused_mlp

    logits = {}
    if rank == 0:
        model = _load(args.model_dir, dtype, None, 1, args.check_layers, args.layers).to(device)
        with torch.inference_mode():
            logits["eager"] = model(probe).logits.float()
            apply_fused_mlp(model, backend=backend)
            logits["patched"] = model(probe).logits.float()
        del model
        _free()
    dist.barrier()
    return logits


def time_plan(args, plan: str, inputs: dict, items: list, backend: str, world: int, dtype, t_start: float) -> dict:
    """The `--layers` model under `plan`: eager and patched in turns on one loaded model."""
    import torch.distributed as dist

    from swiglu_patch import apply_fused_mlp, unpatch

    cuda = torch.cuda.is_available() and not args.dry_run
    rank = dist.get_rank()
    t0 = time.perf_counter()
    model = _load(args.model_dir, dtype, plan, world, args.layers, args.layers)
    load_s = time.perf_counter() - t0
    layout = _layout(model)
    timer, new = Timer(cuda), args.new_tokens

    times = {it: {m: [] for m in MODES} for it in items}
    peaks, tokens, fused, current = {it: {} for it in items if it[0] == "prefill"}, {}, None, "eager"
    with torch.inference_mode():
        for r in range(-1, args.rounds):  # round -1: untimed (compiles the kernels), peaks, tokens
            over = [args.budget_s is not None and time.perf_counter() - t_start > args.budget_s]
            dist.broadcast_object_list(over, src=0)  # every rank stops at the same round
            if r >= 1 and over[0]:
                break
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                if mode != current and mode == "patched":  # the report of a call on a patched model lists none
                    report = apply_fused_mlp(model, backend=backend)
                    fused = fused or {"fused": len(report.experts), "not_fused": len(report.not_patched)}
                elif mode != current:
                    unpatch(model)
                current = mode
                for item in items:
                    if cuda and r == -1 and item[0] == "prefill":
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    seconds, out = timer(item_call(model, item, inputs[item], new))
                    if r == -1:
                        if item[0] == "prefill" and cuda:
                            peaks[item][mode] = (torch.cuda.max_memory_allocated() - base) / 2**20
                        elif item[0] != "prefill":
                            tokens[item, mode] = out[:, args.prompt:].tolist()
                    else:
                        times[item][mode].append(seconds)
                        if rank == 0:  # in the log too, should the run end before results.json
                            print(f"[bench_moe_parallel] {plan} round {r} {mode:7s} {item[0]} {item[1]}: "
                                  f"{seconds:.4f} s", flush=True)
                    del out
        unpatch(model)
    rows = []
    for item in items:
        row = paired_row(item, times[item]["eager"], times[item]["patched"], new)
        if item[0] == "prefill":
            got = gather(peaks[item])
            row["peak_extra_mib_per_rank"] = got if cuda else None
        else:
            a, b = tokens[item, "eager"], tokens[item, "patched"]
            row["leading_tokens_equal"] = min(next((n for n, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
                                              for ra, rb in zip(a, b))
        rows.append(row)
    return {"load_s": round(load_s, 1), "layout": layout, "experts_fused": fused["fused"],
            "experts_not_fused": fused["not_fused"], "rounds_timed": len(rows[0]["eager_s"]) if rows else 0,
            "rows": rows}


def run(args: argparse.Namespace) -> dict:
    cuda = not args.dry_run
    rank, world = init_ranks(cuda)  # rank 0 may save a 61 GB checkpoint while the others wait
    spec = (TINY if args.dry_run else MOE_MODELS)[MODEL]
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "auto" if cuda else "torch"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t_start = time.perf_counter()
    _checkpoint(args, spec, dtype, device, rank)
    checkpoint_s = time.perf_counter() - t_start
    vocab = spec.config["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)  # the same on every rank: the same inputs
    items = [("prefill", p) for p in args.prefill] + [("dynamic", b) for b in args.batches]
    inputs = item_inputs(items, vocab, args.prompt, gen, device)
    probe = torch.randint(2, vocab, (1, 512 if cuda else 32), generator=gen).to(device)
    single = _single_gpu(args, probe, backend, dtype, device, rank) if args.check_layers else {}
    data = {
        "schema": SCHEMA, "kind": "bench_moe_parallel", "env": environment(device, args.commit),
        "model": {"shape": MODEL, "label": spec.label, "layers": args.layers, "dtype": str(dtype).removeprefix("torch."),
                  **{k: spec.config[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                 "num_experts_per_tok", "vocab_size")},
                  "checkpoint_s": round(checkpoint_s, 1)},
        "settings": {"ranks": world, "backend": backend, "rounds": args.rounds, "prefill": args.prefill,
                     "batches": args.batches, "prompt": args.prompt, "new_tokens": args.new_tokens,
                     "budget_s": args.budget_s, "dry_run": args.dry_run,
                     "stat": "wall time, all ranks synchronized; default and patched experts in turns on one loaded "
                             "model, order reversed every other round; per-round ratios"},
        "plans": {},
    }
    for plan in args.plans:
        entry = {"config": distributed_config(plan, world)[1]}
        try:
            if args.check_layers:  # every rank runs the model; rank 0 judges
                plain, patched = plan_logits(args, plan, probe, backend, world, dtype)
                entry["agreement"] = agreement(single, plain, patched, args.check_layers, dtype) if rank == 0 else None
            entry.update(time_plan(args, plan, inputs, items, backend, world, dtype, t_start))
        except Exception as e:  # noqa: BLE001 - a plan failing alike on every rank is recorded; the next one runs
            entry["failed"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if rank == 0:
                traceback.print_exc()
        _free()  # the plan's models, gone with the frames that held them
        data["plans"][plan] = entry
        data["wall_s"] = round(time.perf_counter() - t_start, 1)
        if rank == 0:
            write_json(data, args.out / "results.json")
            (args.out / "results.md").write_text(render_markdown(data))
            print(f"[bench_moe_parallel] {plan} done ({data['wall_s']:.0f} s)", flush=True)
    return data if rank == 0 else {}  # the process group ends in _main, after rank 0 has written


def render_markdown(data: dict) -> str:
    m, s, env = data["model"], data["settings"], data["env"]
    gpu, v = env.get("gpu") or {}, env.get("versions", {})
    lines = [f"# {m['label']} shape, {m['layers']} layers, across {s['ranks']} ranks: TP and EP, transformers' "
             "default experts against the fused ones", "",
             f"- {m['dtype']}; GPU: {gpu.get('name', 'none (dry run on CPU)')} x {s['ranks']}; torch {v.get('torch')}, "
             f"triton {v.get('triton')}, transformers {v.get('transformers')}",
             f"- commit {env['git']['commit']}; measured {env.get('date_utc')}; checkpoint {m['checkpoint_s']} s; "
             f"whole run {data.get('wall_s')} s",
             f"- {s['stat']}; {s['rounds']} rounds asked"]
    for plan, e in data["plans"].items():
        lines += ["", f"## {plan.upper()}: `{e['config']}`", ""]
        if "failed" in e:
            lines.append(f"- failed: {e['failed']}")
        a = e.get("agreement")
        if a:
            lines.append(f"- agreement on the first {a['layers']} layers, logits on a {a['probe_tokens']}-token "
                         "prompt against one GPU's default (relative error, top-1 agreement): "
                         f"one GPU patched {a['one_gpu_patched_vs_eager']['rel']:.2e} "
                         f"({a['one_gpu_patched_vs_eager']['top1']:.3f}); {plan.upper()} default "
                         f"{a['plan_default_vs_one_gpu']['rel']:.2e} ({a['plan_default_vs_one_gpu']['top1']:.3f}); "
                         f"{plan.upper()} patched {a['plan_patched_vs_one_gpu']['rel']:.2e} "
                         f"({a['plan_patched_vs_one_gpu']['top1']:.3f}): "
                         f"{'agrees' if a['agrees'] else 'DOES NOT AGREE'} (bound {a['bound']:.2e}: twice the larger "
                         "of the first two, plus one rounding step)")
        if "layout" not in e:
            continue
        lay = e["layout"]
        lines += [f"- loaded in {e['load_s']} s; {e['rounds_timed']} rounds timed; {e['experts_fused']} experts modules "
                  f"fused by the patch ({e.get('experts_not_fused', 0)} not), of {m['layers']} layers; default experts implementation "
                  f"`{lay['experts_default']}`; a rank's experts gate_up {lay['experts_gate_up']['local_shape']} "
                  f"({', '.join(lay['experts_gate_up']['placements']) or 'whole'}), attention q_proj "
                  f"{lay['attention_q']['local_shape']} ({', '.join(lay['attention_q']['placements']) or 'whole'})"]
        lines += [""] + rows_table(e["rows"], s["new_tokens"], "default")
    lines += ["", "Rates: prefill tokens/s; generate (dynamic cache) tokens/s, batch x new tokens / wall time. "
              "Leading greedy tokens: the fewest over the batch's sequences."]
    if data.get("notes"):  # written into the JSON after the run, each saying so
        lines += ["", "Notes:", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    return finish(parse_args(argv), "bench_moe_parallel", SCHEMA, run, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
