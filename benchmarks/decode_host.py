"""Where the host time of an HF `generate` decode step goes, eager against patched.

Decode of a small batch is host-bound: the GPU finishes each kernel before Python has
launched the next. This script builds `bench_e2e`'s model, runs `generate` in both modes and
reports, per mode:

- wall ms per decode step (`(t(N new) - t(1 new)) / (N - 1)`, GPU synchronized);
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


def profile_mode(model, ids, mask, new: int, reps: int, sync) -> dict:
    def generate(n):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    generate(new)
    sync()
    t_all, t_one = [], []
    for _ in range(reps):  # interleave N-token and 1-token runs: drift cancels in the difference
        for n, times in ((new, t_all), (1, t_one)):
            t0 = time.perf_counter()
            generate(n)
            sync()
            times.append(time.perf_counter() - t0)
    step_ms = (statistics.median(t_all) - statistics.median(t_one)) / (new - 1) * 1e3

    clock = MlpHostClock(_mlps(model))
    generate(new)
    sync()
    mlp_us = clock.total / max(clock.calls, 1) * 1e6
    clock.remove()

    prof = cProfile.Profile()
    prof.enable()
    generate(new)
    sync()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return {"step_ms": step_ms, "mlp_host_us_per_call": mlp_us, "mlp_calls": clock.calls, "cprofile": s.getvalue()}


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
    model = build_model(dims, args.layers, device, torch.bfloat16, seed=0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    data = {"env": environment(device, args.commit), "layers": args.layers, "new_tokens": args.new_tokens, "rows": []}
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(2, dims["vocab_size"], (b, 32), generator=gen).to(device) for b in args.batch}
    with torch.inference_mode():
        for mode in ("eager", "patched"):
            if mode == "patched":
                apply_fused_mlp(model, backend="torch" if args.dry_run else "auto")
            for b, ids in prompts.items():
                r = profile_mode(model, ids, torch.ones_like(ids), args.new_tokens, args.reps, sync)
                data["rows"].append({"mode": mode, "batch": b, **r})
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
