"""End-to-end tokens/s of a Llama-3-8B-shaped model, eager against patched (`apply_fused_mlp`).

    python -m benchmarks.bench_e2e --out OUT [--layers 8] [--commit SHA]
    python -m benchmarks.bench_e2e --render OUT/results.json     # markdown only, CPU
    python -m benchmarks.bench_e2e --dry-run --out /tmp/e2e       # tiny model on CPU, seconds

The model is random-init `LlamaForCausalLM` with Llama-3-8B's real dimensions (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocab 128256, rope theta 500000) but, by default,
8 of its 32 layers (--layers), so a run fits one device call; the report says how many. Built
directly on the GPU in bf16, run under torch.inference_mode(), SDPA attention.

- prefill: one forward of a [1, P] prompt with use_cache=True and logits_to_keep=1 (what
  `generate` runs for the prompt), P = 4096 and 8192; tokens/s = P / median time.
- decode: `generate` with greedy decoding and min_new_tokens = max_new_tokens = 128 (random
  weights would otherwise stop at EOS) on [B, 128] prompts, B = 1 and 32. decode tokens/s =
  B * 127 / (t(128 new) - t(1 new)): the prompt and the first token are subtracted. Without a
  CUDA graph this step is bound by the host's Python, not the GPU.
- decode with the step captured in a CUDA graph (`decode_graph.py`: static KV cache, one replay
  per token, as a serving engine or torch.compile's reduce-overhead mode runs it), the same
  prompts: tokens/s = B / (GPU time per step). Here the GPU time decides.

Two copies of the model are built from one seed, one of them patched; every measurement
times the two in turns (eager, patched, eager, ...), so drift of the host's speed, which
decode is bound by, falls on both alike. Also
recorded: peak GPU memory of the 8192-token prefill in both modes, and whether the patched
model agrees with eager (max |logit diff| on a prompt, greedy tokens identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from .env_info import environment

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128001, pad_token_id=128001, full_layers=32)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
            pad_token_id=1, full_layers=2)
SCHEMA = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/e2e; --render: the JSON's)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8 of Llama-3-8B's 32)")
    p.add_argument("--prefill", type=int, nargs="+", default=None, help="prompt lengths (default 4096 8192)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default 1 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per decode run (default 128)")
    p.add_argument("--decode-prompt", type=int, default=None, help="prompt length of the decode runs (default 128)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median) after one warm-up")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny Llama on CPU, backend torch: checks the pipeline")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    small = args.dry_run
    args.layers = args.layers or (2 if small else 8)
    args.prefill = args.prefill or ([16, 32] if small else [4096, 8192])
    args.batches = args.batches or ([1, 2] if small else [1, 32])
    args.new_tokens = args.new_tokens or (4 if small else 128)
    args.decode_prompt = args.decode_prompt or (8 if small else 128)
    if args.new_tokens < 2 or args.layers < 1 or args.reps < 1:
        p.error("--new-tokens must be >= 2 (decode time is t(N) - t(1)); --layers and --reps >= 1")
    return args


def build_model(dims: dict, layers: int, device: torch.device, dtype: torch.dtype, seed: int):
    """Random-init LlamaForCausalLM with `dims` and `layers` decoder layers, on device, in dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = {k: v for k, v in dims.items() if k != "full_layers"}
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=16384, **cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)  # .to(): a no-op unless init ignored the device


def make_timer(device: torch.device, reps: int):
    """timer({name: fn}) -> {name: median wall seconds}: one warm-up each, then `reps` rounds in
    which every fn runs once in turn, each call synchronized. Taking turns matters here: decode
    is host-bound, and a host that drifts by 10% between one mode's runs and the other's would
    otherwise read as a 10% difference between the modes."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timer(fns: dict) -> dict:
        for fn in fns.values():
            fn()
        sync()
        times: dict = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
        return {name: statistics.median(t) for name, t in times.items()}

    return timer


def _peak_extra_mib(device: torch.device, fn) -> float | None:
    """Peak GPU memory one call of fn allocates above what is allocated before it, MiB."""
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


def measure(models: dict, args: argparse.Namespace, device: torch.device, vocab: int, timer) -> dict:
    """Prefill and decode tokens/s of each model ({mode: model}), the modes timed in turns."""
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    out: dict = {mode: {"prefill": [], "decode": []} for mode in models}
    for p_len in args.prefill:
        ids = torch.randint(2, vocab, (1, p_len), generator=gen).to(device)
        fns = {mode: (lambda m=m: m(ids, use_cache=True, logits_to_keep=1)) for mode, m in models.items()}
        peaks = {mode: _peak_extra_mib(device, fn) for mode, fn in fns.items()}
        secs = timer(fns)
        for mode in models:
            out[mode]["prefill"].append({"prompt": p_len, "s": secs[mode], "tokens_per_s": p_len / secs[mode],
                                         "peak_extra_mib": peaks[mode]})
    new = args.new_tokens
    for batch in args.batches:
        ids = torch.randint(2, vocab, (batch, args.decode_prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)

        def generate(model, n: int):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        fns = {(mode, n): (lambda m=m, n=n: generate(m, n)) for mode, m in models.items() for n in (new, 1)}
        secs = timer(fns)
        for mode, model in models.items():
            t_n, t_1 = secs[(mode, new)], secs[(mode, 1)]
            tokens = generate(model, new)[:, args.decode_prompt:]
            out[mode]["decode"].append({
                "batch": batch, "new_tokens": new, "generated": tokens.shape[1], "s_all": t_n, "s_first": t_1,
                "decode_tokens_per_s": batch * (new - 1) / (t_n - t_1) if t_n > t_1 else None,
                "generate_tokens_per_s": batch * new / t_n,
                "tokens": tokens[0].tolist(),
            })
        out = _decode_graph(models, args, ids, out)
    return out


def _decode_graph(models: dict, args: argparse.Namespace, ids: torch.Tensor, out: dict) -> dict:
    """Decode tokens/s with the step captured in a CUDA graph (`decode_graph.GraphDecoder`) for
    the [B, prompt] ids, the modes timed in turns; on CPU (dry run) the step runs uncaptured."""
    from .decode_graph import GraphDecoder

    new, batch = args.new_tokens, ids.shape[0]
    decoders = {mode: GraphDecoder(m, ids, new, capture=ids.is_cuda) for mode, m in models.items()}
    steps: dict = {mode: [] for mode in models}
    tokens = {mode: d.run()[0][0].tolist() for mode, d in decoders.items()}  # warm-up
    for _ in range(args.reps):
        for mode, d in decoders.items():
            steps[mode].append(d.run()[1] / (new - 1))
    for mode in models:
        step_s = statistics.median(steps[mode])
        out[mode].setdefault("decode_graph", []).append({
            "batch": batch, "new_tokens": new, "step_ms": step_s * 1e3, "decode_tokens_per_s": batch / step_s,
            "tokens": tokens[mode],  # first sequence
        })
    del decoders
    return out


def run(args: argparse.Namespace) -> dict:
    from swiglu_patch import apply_fused_mlp

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_e2e: no CUDA device; run on the GPU, or use --dry-run (CPU) or --render")
    dims, dtype = (TINY if args.dry_run else LLAMA3_8B), torch.bfloat16
    backend = "torch" if args.dry_run else "auto"
    t0 = time.perf_counter()
    eager = build_model(dims, args.layers, device, dtype, args.seed)
    patched = build_model(dims, args.layers, device, dtype, args.seed)  # the same weights
    build_s = time.perf_counter() - t0
    timer = make_timer(device, args.reps)
    probe = torch.randint(2, dims["vocab_size"], (1, min(512, max(args.prefill))),
                          generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    data = {
        "schema": SCHEMA, "kind": "bench_e2e", "env": environment(device, args.commit),
        "model": {**dims, "layers": args.layers, "dtype": str(dtype).removeprefix("torch."), "attn": "sdpa",
                  "params": sum(p.numel() for p in eager.parameters()), "build_s": round(build_s, 1)},
        "settings": {"reps": args.reps, "stat": "median wall time, GPU synchronized, eager and patched taking turns",
                     "decode_prompt": args.decode_prompt, "new_tokens": args.new_tokens, "backend": backend,
                     "dry_run": args.dry_run},
    }
    with torch.inference_mode():
        report = apply_fused_mlp(patched, backend=backend)
        data["patch_report"] = str(report)
        if len(report.patched) != args.layers:
            raise SystemExit(f"bench_e2e: apply_fused_mlp patched {len(report.patched)} of {args.layers} MLPs:\n{report}")
        logits_eager = eager(probe).logits.float()
        logits_fused = patched(probe).logits.float()
        data.update(measure({"eager": eager, "patched": patched}, args, device, dims["vocab_size"], timer))
    diff = (logits_fused - logits_eager).abs()
    data["agreement"] = {
        "probe_tokens": probe.shape[1],
        "max_abs_logit_diff": diff.max().item(),
        "rel_logit_diff": (torch.linalg.vector_norm(logits_fused - logits_eager) / torch.linalg.vector_norm(logits_eager)).item(),
        "top1_agree": (logits_fused.argmax(-1) == logits_eager.argmax(-1)).float().mean().item(),
        "greedy_identical": [e["tokens"] == p["tokens"] for e, p in zip(data["eager"]["decode"], data["patched"]["decode"])],
    }
    return data


def _leading(a: list, b: list) -> int:
    """How many leading tokens two greedy decodes share."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def render_markdown(data: dict) -> str:
    """The e2e report: prefill and decode tables, eager against patched, plus agreement."""
    m, env, a = data["model"], data["env"], data["agreement"]
    git, v = env["git"], env["versions"]
    lines = [
        "# End to end: " + ("tiny Llama (dry run: numbers mean nothing)" if data["settings"]["dry_run"]
                            else "Llama-3-8B shape") + ", eager vs patched (apply_fused_mlp)",
        "",
        f"- model: random-init LlamaForCausalLM, hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, "
        f"**{m['layers']} of {m['full_layers']} layers**, {m['params'] / 1e9:.2f} B params, {m['dtype']}, {m['attn']}",
        f"- GPU: {env['gpu'].get('name')}, driver {env['gpu'].get('driver', '–')}; torch {v.get('torch')}, "
        f"triton {v.get('triton')}, transformers {v.get('transformers')}",
        f"- commit {git['commit']} ({git['source']}); measured {env['date_utc']}",
        f"- {data['settings']['stat']}, {data['settings']['reps']} reps after 1 warm-up; torch.inference_mode()",
        "",
        "## Prefill (batch 1, use_cache=True, logits_to_keep=1)",
        "",
        "| prompt tokens | eager tok/s | patched tok/s | speedup | eager peak extra MiB | patched peak extra MiB |",
        "|---|---|---|---|---|---|",
    ]
    for e, p in zip(data["eager"]["prefill"], data["patched"]["prefill"]):
        lines.append(f"| {e['prompt']} | {e['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{p['tokens_per_s'] / e['tokens_per_s']:.3f}x | {_f(e['peak_extra_mib'], '.0f')} | "
                     f"{_f(p['peak_extra_mib'], '.0f')} |")
    lines += [
        "",
        f"## Decode (generate, greedy, {data['settings']['new_tokens']} new tokens forced, "
        f"prompt {data['settings']['decode_prompt']})",
        "",
        "decode tok/s = batch x (new - 1) / (t(new) - t(1)); generate tok/s = batch x new / t(new).",
        "",
        "| batch | eager decode tok/s | patched decode tok/s | speedup | eager generate tok/s | patched generate tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for e, p in zip(data["eager"]["decode"], data["patched"]["decode"]):
        ratio = p["decode_tokens_per_s"] / e["decode_tokens_per_s"] if e["decode_tokens_per_s"] and p["decode_tokens_per_s"] else None
        lines.append(f"| {e['batch']} | {_f(e['decode_tokens_per_s'], '.1f')} | {_f(p['decode_tokens_per_s'], '.1f')} | "
                     f"{_f(ratio, '.3f')}{'x' if ratio else ''} | {e['generate_tokens_per_s']:.1f} | {p['generate_tokens_per_s']:.1f} |")
    graph = list(zip(data["eager"].get("decode_graph", []), data["patched"].get("decode_graph", [])))
    if graph:
        lines += [
            "",
            f"## Decode, the step captured in a CUDA graph (static KV cache, greedy, {data['settings']['new_tokens']} "
            "new tokens)",
            "",
            "`benchmarks/decode_graph.py`: the prompt runs as one forward, then one graph replay per token; step time "
            "= CUDA-event time of the replays / (new - 1), median of the reps. Leading tokens as `generate`: how many "
            "of the graph decode's first greedy tokens (first sequence) equal those of the `generate` run above, "
            "eager / patched (a random-init model's logits are near ties, so 16-bit rounding differences between the "
            "two paths' kernels end the agreement early; in fp32 the tests find every token equal).",
            "",
            "| batch | eager ms/step | patched ms/step | eager tok/s | patched tok/s | speedup | leading tokens as "
            "generate |",
            "|---|---|---|---|---|---|---|",
        ]
        decode = list(zip(data["eager"]["decode"], data["patched"]["decode"]))
        for (e, p), (eg, pg) in zip(graph, decode):
            lines.append(f"| {e['batch']} | {e['step_ms']:.3f} | {p['step_ms']:.3f} | {e['decode_tokens_per_s']:.1f} | "
                         f"{p['decode_tokens_per_s']:.1f} | {p['decode_tokens_per_s'] / e['decode_tokens_per_s']:.3f}x | "
                         f"{_leading(e['tokens'], eg['tokens'])} / {_leading(p['tokens'], pg['tokens'])} "
                         f"of {len(e['tokens'])} |")
    lines += [
        "",
        "## Agreement of patched with eager",
        "",
        f"- logits on a {a['probe_tokens']}-token prompt: max |diff| {a['max_abs_logit_diff']:.3g}, relative "
        f"{a['rel_logit_diff']:.2e}, top-1 agreement {a['top1_agree']:.4f}",
        "- greedy tokens of the decode runs identical (first sequence, per batch size): "
        + ", ".join(str(x) for x in a["greedy_identical"]) + "; leading tokens equal: "
        + ", ".join(str(_leading(e["tokens"], p["tokens"])) for e, p in zip(data["eager"]["decode"], data["patched"]["decode"])),
        *([f"- the same in the CUDA-graph decode, leading tokens equal: "
           f"{', '.join(str(_leading(e['tokens'], p['tokens'])) for e, p in graph)}"] if graph else []),
        "",
        "```",
        data["patch_report"],
        "```",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        data = json.loads(args.render.read_text())
        out = args.out or args.render.parent
    else:
        out = args.out or Path("benchmarks/results/e2e")
        data = run(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(data, indent=1))
        print(f"[bench_e2e] wrote {out / 'results.json'}")
    out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(data)
    (out / "results.md").write_text(md)
    print(md)
    print(f"[bench_e2e] wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
