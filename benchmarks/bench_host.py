"""Host time per call on the device, from idle: the fused gated GEMM against cuBLAS, and a
patched MLP forward against the eager one.

    python -m benchmarks.bench_host --out OUT [--shape llama-3-8b] [--calls 400] [--rounds 5] [--profile]
    python -m benchmarks.bench_host --render OUT/results.json      # markdown only, CPU
    python -m benchmarks.bench_host --dry-run --out /tmp/host       # CPU, torch backend: checks the pipeline

A decode step with a dynamic cache is bound by the host: the GPU finishes each kernel before
Python has launched the next, so what a layer costs is the host time of its calls. Each call
here is timed alone on the wall clock after a synchronize (`harness/host_time.py`): the launch
queue is empty, so the time is the Python, dispatcher and driver work of the call, never GPU
time. The ways take turns in `--rounds` rounds, the order reversed every other round; the
median of all calls is reported. Ways, all bf16, one token (M = 1), on `--shape`'s K and I,
under torch.inference_mode() as `generate` runs them:

- `gated_linear`: `swiglu_patch.gated_linear(x [1, K], pack_gate_up(Wg, Wu), act)`, eager;
- `gated_gemm`: `swiglu_patch.kernels.dispatch.gated_gemm(x, packed weight, act)`, the dispatcher
  under gated_linear's checks (GPU only);
- `F.linear`: cuBLAS `F.linear(x [1, K], Wg [I, K])`, one of the projections eager runs;
- `mlp_eager`: the model's MLP module (LlamaMLP, Qwen2MLP) on x [1, 1, K]: gate, up, act, mul, down;
- `mlp_patched`: the same MLP after `apply_fused_mlp`: FusedGatedMLP, the gated GEMM then down;
- `mlp_train_eager`, `mlp_train_patched`: a training step's part of the two MLPs, forward +
  backward on x [1, TRAIN_TOKENS, K] with every weight trainable and the gradients set to None
  first, as a Trainer's zero_grad does (outside inference_mode; the patched one runs the fused
  training op, store mode).

Targets (issue 18): `gated_linear` at most 25 µs; `mlp_patched` at most 0.75x `mlp_eager`.
`--profile` adds a cProfile of `--profile-calls` patched MLP forwards (each from idle): the
functions by own time and by cumulative time, printed and written to OUT/profile_mlp_patched.txt.

--dry-run builds a tiny model on CPU with the torch backend (the Triton kernel under the
interpreter takes milliseconds per call, which says nothing about a launch): it checks the
pipeline, not the numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .harness.cli import Parser, UsageError, guarded, read_json, require_cuda, write_json
from .harness.host_time import host_from_idle, synchronizer, us_stats
from .harness.models import MODELS, TINY, build_model, mlps

PROG = "python -m benchmarks.bench_host"
SCHEMA = 1
WAYS = ("gated_linear", "gated_gemm", "F.linear", "mlp_eager", "mlp_patched", "mlp_train_eager", "mlp_train_patched")
TRAIN_TOKENS = 16  # the training ways' x: few tokens, so the step's GPU work is short beside its host time
GATED_LINEAR_TARGET_US = 25.0
MLP_TARGET = 0.75


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shape", choices=sorted(MODELS), default="llama-3-8b", help="the MLP's dimensions")
    p.add_argument("--calls", type=positive_int, help="timed calls per way (default 400; the dry run 20)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds the ways take turns in")
    p.add_argument("--profile", action="store_true", help="also a cProfile of the patched MLP forward")
    p.add_argument("--profile-calls", type=positive_int, default=200, help="patched forwards in the profile")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, torch backend: checks the pipeline")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only rebuild results.md from a results JSON")
    args = p.parse_args(argv)
    if args.out is None and not args.render:
        p.error("--out is required: the folder for results.json and results.md")
    args.calls = args.calls or (20 if args.dry_run else 400)
    return args


def build_ways(dims, device: torch.device, dtype: torch.dtype, backend: str, seed: int) -> tuple[dict, dict, tuple]:
    """({way: zero-argument callable}, {way: why it is skipped}, (eager MLP, patched MLP)); the
    MLPs are one layer's, built from one seed, one of them patched."""
    from swiglu_patch import FusedGatedMLP, apply_fused_mlp, gated_linear, pack_gate_up

    eager, patched = (build_model(dims, 1, device, dtype, seed, vocab=256) for _ in range(2))
    apply_fused_mlp(patched, backend=backend)
    mlp_eager, mlp_patched = mlps(eager)[0], mlps(patched)[0]
    if not isinstance(mlp_patched, FusedGatedMLP):
        raise RuntimeError(f"bench_host: apply_fused_mlp left {type(mlp_patched).__name__} in place")
    gate, up = mlp_eager.gate_proj.weight, mlp_eager.up_proj.weight
    packed = pack_gate_up(gate, up)
    act = mlp_patched.epilogue.activation
    x2, x3 = torch.randn(1, dims.hidden, device=device, dtype=dtype), torch.randn(1, 1, dims.hidden, device=device,
                                                                                  dtype=dtype)
    ways, skipped = {}, {}
    ways["gated_linear"] = lambda: gated_linear(x2, packed, act, backend=backend)
    if device.type == "cuda":
        from swiglu_patch.kernels.dispatch import gated_gemm

        weight = packed.weight
        ways["gated_gemm"] = lambda: gated_gemm(x2, weight, act)
    else:
        skipped["gated_gemm"] = "the Triton kernel on CPU runs in the interpreter: not a launch to time"
    ways["F.linear"] = lambda: F.linear(x2, gate)
    ways["mlp_eager"] = lambda: mlp_eager(x3)
    ways["mlp_patched"] = lambda: mlp_patched(x3)
    return ways, skipped, (mlp_eager, mlp_patched)


def train_ways(mlps_pair, hidden: int, device: torch.device, dtype: torch.dtype) -> dict:
    """{way: zero-argument callable}: forward + backward of each MLP on x [1, TRAIN_TOKENS, K]
    (grad mode on), its parameters' gradients set to None first."""
    x = torch.randn(1, TRAIN_TOKENS, hidden, device=device, dtype=dtype)
    dy = torch.randn(1, TRAIN_TOKENS, hidden, device=device, dtype=dtype)

    def step(mlp):
        params = [p.requires_grad_() for p in mlp.parameters()]

        def call():
            for p in params:
                p.grad = None
            mlp(x).backward(dy)
        return call

    return {"mlp_train_eager": step(mlps_pair[0]), "mlp_train_patched": step(mlps_pair[1])}


def profile_calls(fn, calls: int, sync) -> str:
    """cProfile of `calls` calls of fn, each started on an idle device (the synchronize between
    calls is not profiled): top functions by own time, then by cumulative time."""
    prof = cProfile.Profile()
    fn()
    for _ in range(calls):
        sync()
        prof.enable()
        fn()
        prof.disable()
    sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"cProfile of {calls} calls, each from an idle device; times are totals over the calls\n\n")
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    return text.getvalue()


def run(args: argparse.Namespace) -> dict:
    if not args.dry_run:
        require_cuda(PROG)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dims = (TINY if args.dry_run else MODELS)[args.shape]
    dtype, backend = torch.bfloat16, ("torch" if args.dry_run else "auto")
    sync = synchronizer(device)
    data = {
        "schema": SCHEMA, "kind": "bench_host", "env": environment(device, args.commit),
        "shape": {"name": dims.name, "label": dims.label, "hidden": dims.hidden, "intermediate": dims.intermediate,
                  "M": 1, "train_M": TRAIN_TOKENS, "dtype": str(dtype).removeprefix("torch.")},
        "settings": {"calls": args.calls, "rounds": args.rounds, "backend": backend, "dry_run": args.dry_run,
                     "stat": "host wall time of one call started on an idle device (synchronized before "
                             "it), ways in turns, order reversed every other round; median (p10-p90) of all calls"},
        "targets": {"gated_linear_us": GATED_LINEAR_TARGET_US, "mlp_patched_over_eager": MLP_TARGET},
    }
    t0 = time.perf_counter()
    with torch.inference_mode():
        ways, skipped, _ = build_ways(dims, device, dtype, backend, args.seed)
        samples = host_from_idle(ways, args.calls, args.rounds, sync)
        if args.profile:
            data["profile_mlp_patched"] = profile_calls(ways["mlp_patched"], args.profile_calls, sync)
    # the training ways need autograd: MLPs built anew outside inference_mode (its tensors cannot be saved)
    _, _, mlp_pair = build_ways(dims, device, dtype, backend, args.seed)
    samples |= host_from_idle(train_ways(mlp_pair, dims.hidden, device, dtype), args.calls, args.rounds, sync)
    data["ways"] = {w: us_stats(samples[w]) if w in samples else {"skipped": skipped[w]} for w in WAYS}
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    return data


def _us(data: dict, way: str) -> float | None:
    return data["ways"].get(way, {}).get("median_us")


def verdicts(data: dict) -> list[tuple[str, float | None, str]]:
    """(target text, measured value, "met" | "missed" | "n/a") of the two targets."""
    gl, eager, patched = _us(data, "gated_linear"), _us(data, "mlp_eager"), _us(data, "mlp_patched")
    ratio = patched / eager if patched and eager else None
    out = [(f"gated_linear <= {GATED_LINEAR_TARGET_US:g} µs", gl, gl <= GATED_LINEAR_TARGET_US if gl else None),
           (f"mlp_patched <= {MLP_TARGET:g}x mlp_eager", ratio, ratio <= MLP_TARGET if ratio else None)]
    return [(text, v, "n/a" if ok is None else ("met" if ok else "missed")) for text, v, ok in out]


def render_markdown(data: dict) -> str:
    env, s, shape = data["env"], data["settings"], data["shape"]
    git, v = env["git"], env["versions"]
    dirty = " (working tree had uncommitted changes)" if git.get("dirty") else ""
    lines = [
        "# Host time per call, from an idle device" + (" (dry run on CPU: numbers mean nothing)" if s["dry_run"] else ""),
        "",
        f"- {shape['label']} shape: K = {shape['hidden']}, I = {shape['intermediate']}, M = 1, {shape['dtype']}, "
        "torch.inference_mode()" + (f"; the training ways (forward + backward, grad on) M = {shape['train_M']}, their "
                                    "column / mlp_eager is over `mlp_train_eager`" if "train_M" in shape else ""),
        f"- GPU: {env['gpu'].get('name')}, driver {env['gpu'].get('driver', '–')}; host CPU {env['host'].get('cpu')}",
        f"- torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, python "
        f"{v.get('python')}",
        f"- commit {git['commit']} ({git['source']}){dirty}; measured {env['date_utc']}",
        f"- {s['stat']}; {s['calls']} calls per way in {s['rounds']} rounds",
        "",
        "| way | median µs | p10-p90 µs | / F.linear | / mlp_eager |",
        "|---|---|---|---|---|",
    ]
    lin = _us(data, "F.linear")
    for way in (w for w in WAYS if w in data["ways"]):  # results from before the training ways lack them
        mlp = _us(data, "mlp_train_eager" if way.startswith("mlp_train") else "mlp_eager")
        w = data["ways"].get(way, {})
        if "median_us" not in w:
            lines.append(f"| `{way}` | skipped: {w.get('skipped', 'not measured')} | | | |")
            continue
        m = w["median_us"]
        per_linear = f"{m / lin:.2f}" if lin else "–"
        per_mlp = f"{m / mlp:.2f}" if mlp and way.startswith("mlp") else ""
        lines.append(f"| `{way}` | {m:.1f} | {w['p10_us']:.1f}-{w['p90_us']:.1f} | {per_linear} | {per_mlp} |")
    lines += ["", "Targets:", ""]
    for text, value, verdict in verdicts(data):
        lines.append(f"- {text}: **{verdict}**" + ("" if value is None else f" ({value:.3g})"))
    if data.get("profile_mlp_patched"):
        lines += ["", "## Where the patched MLP forward's host time goes", "", "```",
                  data["profile_mlp_patched"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 2 on a bad argument, with one line on stderr."""
    return guarded(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.render:
        data = read_json(args.render)
        if data.get("kind") != "bench_host":
            raise UsageError(f"{args.render}: not a bench_host results JSON (kind {data.get('kind')!r})")
        out = args.out or args.render.parent
    else:
        out = args.out
        data = run(args)
        print(f"[bench_host] wrote {write_json(data, out / 'results.json')}")
        if data.get("profile_mlp_patched"):
            (out / "profile_mlp_patched.txt").write_text(data["profile_mlp_patched"])
            print(data["profile_mlp_patched"])
    out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(data)
    (out / "results.md").write_text(md)
    print(md.split("\n## ")[0])
    print(f"[bench_host] wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
