"""Where the host time of an HF `generate` decode step goes, eager against patched.

Decode of a small batch is host-bound: the GPU finishes each kernel before Python has
launched the next. This script builds `bench_e2e`'s model, runs `generate` in both modes and
reports, per mode:

- wall ms per decode step (`(t(N new) - t(1 new)) / (N - 1)`, GPU synchronized), the two
  modes on two copies of the model timed in turns (the host's speed drifts by tens of percent
  between minutes on the device machine: a run of one mode after the other measures that);
- host µs spent inside each MLP's forward per call (forward pre/post hooks, no sync: the
  time Python takes to launch the MLP's kernels, which is what a host-bound step pays);
- the top functions of a cProfile of one `generate`, by own time.

    python -m benchmarks.decode_host --out $OUT/decode_host [--layers 8] [--batch 1]
    python -m benchmarks.decode_host --dry-run --out /tmp/dh     # tiny model on CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from .bench_e2e import LLAMA3_8B, TINY, build_model
from .env_info import environment


def _mlps(model) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


class MlpHostClock:
    """Sums host seconds spent inside the forwards of `modules` (pre/post hooks)."""

    def __init__(self, modules):
        self.total, self.calls, self._t0 = 0.0, 0, 0.0
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        self.total += time.perf_counter() - self._t0
        self.calls += 1

    def reset(self):
        self.total, self.calls = 0.0, 0

    def remove(self):
        for h in self._handles:
            h.remove()


def _generate(model, ids, n: int):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)


def step_ms(models: dict, ids, new: int, reps: int, sync) -> dict:
    """{mode: wall ms per decode step}: (t(new) - t(1)) / (new - 1), medians of `reps` rounds in
    which every (mode, n) runs in turn, so host drift falls on all modes alike."""
    times = {(mode, n): [] for mode in models for n in (new, 1)}
    for mode, model in models.items():
        _generate(model, ids, new)
    for _ in range(reps):
        for (mode, n), ts in times.items():
            sync()
            t0 = time.perf_counter()
            _generate(models[mode], ids, n)
            sync()
            ts.append(time.perf_counter() - t0)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    return {mode: (med[(mode, new)] - med[(mode, 1)]) / (new - 1) * 1e3 for mode in models}


def mlp_host_and_profile(model, ids, new: int, sync) -> dict:
    """Host µs per MLP forward over one generate, and a cProfile of another."""
    clock = MlpHostClock(_mlps(model))
    _generate(model, ids, new)
    sync()
    mlp_us = clock.total / max(clock.calls, 1) * 1e6
    clock.remove()
    prof = cProfile.Profile()
    prof.enable()
    _generate(model, ids, new)
    sync()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return {"mlp_host_us_per_call": mlp_us, "mlp_calls": clock.calls, "cprofile": s.getvalue()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--commit", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU (torch backend)")
    args = p.parse_args(argv)
    from swiglu_patch import apply_fused_mlp

    device = torch.device("cpu" if args.dry_run else "cuda")
    dims = TINY if args.dry_run else LLAMA3_8B
    models = {mode: build_model(dims, args.layers, device, torch.bfloat16, seed=0) for mode in ("eager", "patched")}
    apply_fused_mlp(models["patched"], backend="torch" if args.dry_run else "auto")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    data = {"env": environment(device, args.commit), "layers": args.layers, "new_tokens": args.new_tokens, "rows": []}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in args.batch:
            ids = torch.randint(2, dims["vocab_size"], (b, 32), generator=gen).to(device)
            steps = step_ms(models, ids, args.new_tokens, args.reps, sync)
            for mode, model in models.items():
                r = {"mode": mode, "batch": b, "step_ms": steps[mode],
                     **mlp_host_and_profile(model, ids, args.new_tokens, sync)}
                data["rows"].append(r)
                print(f"{mode:8s} batch {b:3d}: {r['step_ms']:.3f} ms/step, MLP forward host "
                      f"{r['mlp_host_us_per_call']:.1f} us/call", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_host.json").write_text(json.dumps(data, indent=1))
    with open(args.out / "decode_host_cprofile.txt", "w") as f:
        for r in data["rows"]:
            f.write(f"===== {r['mode']} batch {r['batch']}\n{r['cprofile']}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
