"""LoRA on one gated MLP: the adapters inside the fused GEMMs, against PEFT on eager and on Liger.

    python -m benchmarks.bench_lora --out OUT [--shape llama-3-8b] [--ranks 16 64] [--ms 4096 8192]
    python -m benchmarks.bench_lora --dry-run --out /tmp/lora           # CPU, tiny shape, fp32
    python -m benchmarks.bench_lora --render OUT/results.json           # markdown only

One MLP of a real model's shape (transformers' LlamaMLP, bf16, random init from one seed)
with PEFT LoRA adapters (rank r, alpha 2r, dropout 0, B drawn random so the update is real)
on gate_proj, up_proj and down_proj; the base frozen; x requires grad, as inside a model whose
earlier layers have adapters too. Ways:

- peft: the MLP as transformers builds it, adapters by `peft.inject_adapter_in_model`;
- liger: Liger-Kernel's `LigerSwiGLUMLP` (its fused SiLU * up), the same adapters;
- ours: `apply_fused_mlp`, then the adapters through `swiglu_patch.lora.register` (gate/up's
  in the forward GEMM's low-rank segment, down_proj's gradient in the backward GEMM);
- base: ours with no adapters, the frozen base alone: ours / base is what the adapters cost.

Rows: "train" (forward + backward of sum(y * dY), dY fixed) at each --ms, and "infer" (the
forward under inference_mode) at each --ms and --decode-ms; every way at every rank. Timing:
`harness.timing.GraphTimer` (CUDA-graph replays, L2 flushed by a read, ways interleaved);
peak memory of one train call above what was allocated before it. Before timing, each way's y,
dx and adapter gradients are checked against the same adapters in float64 (relative error,
next to PEFT's own bf16 error).

Decode rows (--decode-ms) also time each way as `generate` runs it without a CUDA graph
(`harness.host_time`, the ways in turns, `--host-calls` calls each): "host" is the time a call
takes to return when started on an idle GPU (its Python, dispatcher and launch work), and
"eager" the time to return and synchronize (host plus the GPU's tail), per call.

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .harness.accuracy import rel_error
from .harness.cli import Parser, guarded, render_or_run, require_cuda
from .harness.shapes import SHAPES

PROG = "python -m benchmarks.bench_lora"
SCHEMA = 1
WAYS = ("peft", "liger", "ours", "base")
TARGETS = ["gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shape", choices=[s.name for s in SHAPES], default="llama-3-8b")
    p.add_argument("--ranks", nargs="+", type=positive_int, default=[16, 64], help="LoRA ranks r")
    p.add_argument("--ms", nargs="+", type=positive_int, help="tokens of the train and infer rows (default 4096 8192)")
    p.add_argument("--decode-ms", nargs="*", type=positive_int, help="tokens of infer-only rows (default 1 16)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--rep-ms", type=float, default=150.0, help="GPU ms of timed calls per way and row")
    p.add_argument("--host-calls", type=positive_int, default=600, help="calls per way of the decode rows' host timing")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny shape on CPU, fp32, backend torch, no timing")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render RESULTS_JSON)")
    args.ms = args.ms or ([8, 33] if args.dry_run else [4096, 8192])
    args.decode_ms = [1, 16] if args.decode_ms is None else args.decode_ms
    return args


def _liger_mlp_class():
    try:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError as e:
        return None, f"liger_kernel not importable ({e})"
    return LigerSwiGLUMLP, None


def build_way(way: str, config, rank: int, device, dtype, seed: int, backend: str) -> nn.Module:
    """A holder module with `.mlp`: the way's MLP and adapters, the same weights for every way."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.models.llama.modeling_llama import LlamaMLP

    from swiglu_patch import apply_fused_mlp
    from swiglu_patch.lora import register

    torch.manual_seed(seed)
    holder = nn.Module()
    with torch.device(device):
        holder.mlp = LlamaMLP(config).to(dtype)
    if way == "liger":
        liger_cls, reason = _liger_mlp_class()
        if liger_cls is None:
            raise RuntimeError(reason)
        with torch.device(device):
            liger = liger_cls(config).to(dtype)
        liger.load_state_dict(holder.mlp.state_dict())
        holder.mlp = liger
    if way in ("ours", "base"):
        apply_fused_mlp(holder, backend=backend)
    holder.requires_grad_(False)
    if way == "base":
        return holder
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(seed + 1)  # the same adapters for every way (drawn in the same module order)
    inject_adapter_in_model(register(lora) if way == "ours" else lora, holder)
    for name, p in holder.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return holder


def adapter_grads(holder: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in holder.named_parameters() if "lora_" in n and p.grad is not None}


def _train_call(holder, x, dy):
    def call():
        y = holder.mlp(x)
        torch.autograd.backward(y, dy)
    return call


def _infer_call(holder, x):
    def call():
        with torch.inference_mode():
            holder.mlp(x)
    return call


def check_way(holder, ref64, x, dy) -> dict:
    """{quantity: relative error against float64} of y, dx and every adapter gradient."""
    def run(h, xx, dd):
        xx = xx.detach().clone().requires_grad_()
        h.zero_grad(set_to_none=True)
        y = h.mlp(xx)
        torch.autograd.backward(y, dd)
        return y.detach(), xx.grad, adapter_grads(h)

    y, dx, grads = run(holder, x, dy)
    y64, dx64, grads64 = run(ref64, x.double(), dy.double())
    errs = {"y": rel_error(y, y64), "dx": rel_error(dx, dx64)}
    if grads:
        errs["adapters"] = max(rel_error(grads[n], grads64[n]) for n in grads64)
    holder.zero_grad(set_to_none=True)
    return errs


def run(args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig

    if not args.dry_run:
        require_cuda(PROG)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    backend = "torch" if args.dry_run else "auto"
    shape = next(s for s in SHAPES if s.name == args.shape)
    k, i = (64, 160) if args.dry_run else (shape.hidden, shape.intermediate)
    config = LlamaConfig(hidden_size=k, intermediate_size=i, hidden_act="silu")
    skipped, ways = {}, list(args.ways)
    if "liger" in ways:
        _, reason = _liger_mlp_class()
        reason = reason or ("Liger's kernels need a GPU" if args.dry_run else None)
        if reason:
            skipped["liger"], ways = reason, [w for w in ways if w != "liger"]
    timer = None
    if not args.dry_run:
        from .harness.timing import GraphTimer

        timer = GraphTimer(warmup_ms=20.0, rep_ms=args.rep_ms, rounds=4)
    rows = []
    for rank in args.ranks:
        holders = {w: build_way(w, config, rank, device, dtype, args.seed, backend) for w in ways}
        ref64 = copy.deepcopy(build_way("peft", config, rank, device, dtype, args.seed, "torch")).double()
        gen = torch.Generator(device=device).manual_seed(args.seed + 2)
        for phase, ms in (("train", args.ms), ("infer", args.ms + args.decode_ms)):
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype, generator=gen).requires_grad_(phase == "train")
                dy = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
                row = {"phase": phase, "rank": rank, "m": m, "k": k, "i": i, "ways": {}}
                if phase == "train":
                    row["errors"] = {w: check_way(h, ref64, x, dy) for w, h in holders.items() if w != "base"}
                fns = {w: (_train_call(h, x, dy) if phase == "train" else _infer_call(h, x))
                       for w, h in holders.items()}
                if phase == "infer" and m in args.decode_ms:
                    row["per_call"] = per_call_times(fns, device, 20 if args.dry_run else args.host_calls)
                if timer is not None:
                    row["ways"] = {w: {"us": s * 1e6} for w, s in timer.many(fns).items()}
                    row["timer_modes"] = dict(timer.modes)
                    if phase == "train":
                        for w, fn in fns.items():
                            torch.cuda.synchronize()
                            before = torch.cuda.memory_allocated()
                            torch.cuda.reset_peak_memory_stats()
                            fn()
                            torch.cuda.synchronize()
                            row["ways"][w]["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
                else:
                    for fn in fns.values():  # the dry run: every way runs once
                        fn()
                rows.append(row)
                print(f"[bench_lora] {phase} r={rank} M={m}: " + ", ".join(
                    f"{w} {v['us']:.0f} us" for w, v in row["ways"].items()) + (
                    f"; errors {row['errors']}" if "errors" in row else ""), flush=True)
                for h in holders.values():
                    h.zero_grad(set_to_none=True)
        del holders, ref64
    return {"schema": SCHEMA, "kind": "bench_lora", "env": environment(device, args.commit),
            "shape": {"name": shape.name, "label": f"tiny K={k}, I={i} (dry run)" if args.dry_run else shape.label,
                      "k": k, "i": i, "dtype": str(dtype).removeprefix("torch.")},
            "settings": {"ranks": args.ranks, "ms": args.ms, "decode_ms": args.decode_ms, "targets": TARGETS,
                         "dropout": 0.0, "dry_run": args.dry_run,
                         "timer": timer.describe() if timer is not None else "none (dry run)"},
            "skipped": skipped, "rows": rows}


def per_call_times(fns: dict, device, calls: int) -> dict:
    """{way: {"host_us", "eager_us"}}: median µs of one call from an idle GPU to its return, and to
    its return and a synchronize, the ways in turns (`harness.host_time.host_from_idle`)."""
    from .harness.host_time import host_from_idle, synchronizer

    sync = synchronizer(device)
    rounds = 6
    host = host_from_idle(fns, calls, rounds, sync)
    eager = host_from_idle({w: (lambda fn=fn: (fn(), sync())) for w, fn in fns.items()}, calls, rounds, sync)
    return {w: {"host_us": statistics.median(host[w]) * 1e6, "eager_us": statistics.median(eager[w]) * 1e6} for w in fns}


def render_markdown(data: dict) -> str:
    env, s, shape = data["env"], data["settings"], data["shape"]
    gpu = (env.get("gpu") or {}).get("name", "none (dry run on CPU)")
    v = env.get("versions", {})
    lines = [f"# LoRA on one gated MLP: {shape['label']}, {shape['dtype']}",
             "",
             f"- adapters on {', '.join(s['targets'])}, alpha 2r, dropout {s['dropout']}; base frozen, x requires grad",
             f"- GPU: {gpu}; torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, "
             f"peft {v.get('peft')}, liger-kernel {v.get('liger-kernel')}",
             f"- commit {env['git']['commit']}; measured {env.get('date_utc')}",
             f"- timer: {s['timer']}",
             "",
             "| phase | r | M | peft µs | liger µs | ours µs | base µs | ours / peft | ours / liger | ours / base "
             "| peak MiB peft / liger / ours | rel. error vs float64: peft / ours (y, dx, adapters) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        w = row["ways"]
        us = {name: w[name]["us"] for name in WAYS if name in w}
        ratio = lambda a, b: f"{us[a] / us[b]:.3f}x" if a in us and b in us else "–"  # noqa: E731
        peaks = " / ".join(f"{w[n]['peak_mib']:.0f}" if "peak_mib" in w.get(n, {}) else "–"
                           for n in ("peft", "liger", "ours"))
        errs = row.get("errors", {})
        err = " / ".join(", ".join(f"{e:.1e}" for e in errs[n].values()) if n in errs else "–" for n in ("peft", "ours"))
        lines.append(f"| {row['phase']} | {row['rank']} | {row['m']} | "
                     + " | ".join(f"{us[n]:.0f}" if n in us else "–" for n in WAYS)
                     + f" | {ratio('ours', 'peft')} | {ratio('ours', 'liger')} | {ratio('ours', 'base')} | {peaks} | "
                       f"{err if errs else '–'} |")
    per_call = [row for row in data["rows"] if "per_call" in row]
    if per_call:
        lines += ["", "Decode calls as `generate` makes them without a CUDA graph: median µs per call from an idle GPU, "
                  "to return (host) and to return and synchronize (eager).", "",
                  "| r | M | " + " | ".join(f"{w} host / eager" for w in WAYS) + " | ours / peft host | ours / peft eager |",
                  "|---|---|" + "---|" * (len(WAYS) + 2)]
        for row in per_call:
            t = row["per_call"]
            cells = [f"{t[w]['host_us']:.0f} / {t[w]['eager_us']:.0f}" if w in t else "–" for w in WAYS]
            ratio = lambda key: f"{t['ours'][key] / t['peft'][key]:.3f}x" if "ours" in t and "peft" in t else "–"  # noqa: E731
            lines.append(f"| {row['rank']} | {row['m']} | " + " | ".join(cells) + f" | {ratio('host_us')} | {ratio('eager_us')} |")
    for way, reason in data["skipped"].items():
        lines.append(f"\n{way}: not run ({reason})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    return render_or_run(parse_args(argv), "bench_lora", SCHEMA, run, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
