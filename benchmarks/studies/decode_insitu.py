"""Study: the host time of real decode steps, and of the MLPs inside them, eager against patched.

`bench_host` times one MLP call from an idle GPU, again and again: its code and data stay hot in
the CPU's caches. Inside a decode step the MLP runs between attention, norms and the cache, so
this study times the step itself: the Llama-3-8B shape with 8 layers (`harness.models`), a
DynamicCache filled by a 128-token prompt, then `model(token, past_key_values=cache)` steps,
10 per mode in turns over 11 rounds (the first dropped), order reversed every other round. Per
step: the host time of the forward (it returns before the GPU finishes), the host time inside
the 8 MLP modules (a forward pre-hook and hook with `perf_counter` in both modes), the wall
time to a synchronize, and the garbage collector's time (`gc.callbacks`).

Two settings in one process, the first as users run it: PyTorch's SDPA backends as they come
(cuDNN attention enabled), then `torch.backends.cuda.enable_cudnn_sdp(False)`.

Run on the GPU from the repo root: `OUT=A python benchmarks/studies/decode_insitu.py [COMMIT]`;
writes A/results.json and A/results.md. Ran at 551a56b (`../results/h100/studies/decode_insitu/`).
"""
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from swiglu_patch.provenance import environment  # noqa: E402
from benchmarks.harness.models import MODELS, build_model, mlps  # noqa: E402
from swiglu_patch import apply_fused_mlp  # noqa: E402

MODES = ("eager", "patched")
ROUNDS, STEPS, PROMPT = 11, 10, 128

dev = torch.device("cuda")
models = {mode: build_model(MODELS["llama-3-8b"], 8, dev, torch.bfloat16, 0) for mode in MODES}
apply_fused_mlp(models["patched"])

mlp_s = dict.fromkeys(MODES, 0.0)
gc_s = dict.fromkeys(MODES, 0.0)
current = ["eager"]
_gc_start = [0.0]


def _gc(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        gc_s[current[0]] += time.perf_counter() - _gc_start[0]


gc.callbacks.append(_gc)
for mode, model in models.items():
    started = {}
    for m in mlps(model):
        m.register_forward_pre_hook(lambda mod, args, s=started: s.__setitem__("t", time.perf_counter()))
        m.register_forward_hook(
            lambda mod, args, out, s=started, k=mode: mlp_s.__setitem__(k, mlp_s[k] + time.perf_counter() - s["t"]))


def run_batch(batch: int) -> dict:
    steps = {mode: {"step_host_us": [], "mlp_host_us": [], "step_wall_us": []} for mode in MODES}
    gc_total = dict.fromkeys(MODES, 0.0)
    with torch.inference_mode():
        ids = torch.randint(2, 1000, (batch, PROMPT), device=dev)
        token = torch.randint(2, 1000, (batch, 1), device=dev)
        caches = {}
        for mode, model in models.items():
            caches[mode] = DynamicCache(config=model.config)
            model(ids, past_key_values=caches[mode], use_cache=True, logits_to_keep=1)
        for rnd in range(ROUNDS):
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                current[0] = mode
                for _ in range(STEPS):
                    torch.cuda.synchronize()
                    mlp_s[mode] = gc_s[mode] = 0.0
                    t0 = time.perf_counter()
                    models[mode](token, past_key_values=caches[mode], use_cache=True, logits_to_keep=1)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if rnd:
                        s = steps[mode]
                        s["step_host_us"].append((t1 - t0) * 1e6)
                        s["mlp_host_us"].append(mlp_s[mode] * 1e6)
                        s["step_wall_us"].append((t2 - t0) * 1e6)
                        gc_total[mode] += gc_s[mode]
    row = {"batch": batch}
    for mode, s in steps.items():
        host = sorted(s["step_host_us"])
        row[mode] = {k: statistics.median(v) for k, v in s.items()}
        row[mode].update(steps=len(host), p90_step_host_us=host[9 * len(host) // 10], max_step_host_us=host[-1],
                         steps_over_20ms=sum(h > 20e3 for h in host), gc_ms=gc_total[mode] * 1e3)
    e, p = row["eager"], row["patched"]
    row["patched_over_eager"] = {k: p[k] / e[k] for k in ("step_host_us", "mlp_host_us", "step_wall_us")}
    row["rest_host_us"] = {m: row[m]["step_host_us"] - row[m]["mlp_host_us"] for m in MODES}
    return row


settings = []
for label, cudnn in (("SDPA backends as they come (cuDNN attention on)", True), ("cuDNN attention off", False)):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    rows = [run_batch(b) for b in (1, 8, 32)]
    settings.append({"setting": label, "cudnn_sdp": cudnn, "rows": rows})
    for r in rows:
        print(f"[decode_insitu] {label}, batch {r['batch']}: step host {r['eager']['step_host_us']:.0f} / "
              f"{r['patched']['step_host_us']:.0f} us, MLPs {r['eager']['mlp_host_us']:.0f} / "
              f"{r['patched']['mlp_host_us']:.0f}, rest {r['rest_host_us']['eager']:.0f} / "
              f"{r['rest_host_us']['patched']:.0f}, steps over 20 ms {r['eager']['steps_over_20ms']} / "
              f"{r['patched']['steps_over_20ms']}", flush=True)

data = {"study": "decode_insitu", "env": environment(dev, sys.argv[1] if len(sys.argv) > 1 else None),
        "model": "Llama-3-8B shape, 8 layers, bf16, sdpa, random init", "prompt": PROMPT, "rounds": ROUNDS - 1,
        "steps_per_round": STEPS, "settings": settings}
lines = ["# Decode steps in situ: host time of the step and of its MLPs, eager / patched", "",
         f"- {data['model']}; DynamicCache after a {PROMPT}-token prompt; {STEPS} steps per mode in turns over "
         f"{ROUNDS - 1} timed rounds; medians over the steps", f"- GPU {data['env']['gpu'].get('name')}, commit "
         f"{data['env']['git']['commit']}, torch {torch.__version__}", "",
         "| setting | batch | step host µs, eager / patched | MLPs' host µs (8 layers) | the rest of the step | "
         "step wall µs | steps over 20 ms (of each mode's) | GC ms |", "|---|---|---|---|---|---|---|---|"]
for s in settings:
    for r in s["rows"]:
        e, p = r["eager"], r["patched"]
        lines.append(f"| {s['setting']} | {r['batch']} | {e['step_host_us']:.0f} / {p['step_host_us']:.0f} | "
                     f"{e['mlp_host_us']:.0f} / {p['mlp_host_us']:.0f} | {r['rest_host_us']['eager']:.0f} / "
                     f"{r['rest_host_us']['patched']:.0f} | {e['step_wall_us']:.0f} / {p['step_wall_us']:.0f} | "
                     f"{e['steps_over_20ms']} / {p['steps_over_20ms']} of {e['steps']} | "
                     f"{e['gc_ms']:.1f} / {p['gc_ms']:.1f} |")
out = Path(os.environ.get("OUT", "decode_insitu"))
out.mkdir(parents=True, exist_ok=True)
(out / "results.json").write_text(json.dumps(data, indent=1))
(out / "results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
