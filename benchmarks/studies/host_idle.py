"""Study: where one call's host time goes when it starts on an idle GPU (M = 1, Llama-3-8B shape).

Each row: synchronize, then time one call on the wall clock; rows in turns, 5 rounds, median."""
import json, os, statistics, time
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime import driver

from swiglu_patch import gated_linear, pack_gate_up
from swiglu_patch.kernels import dispatch
from swiglu_patch.kernels.epilogue import GatedEpilogue

dev, dtype = "cuda", torch.bfloat16
K, I = 4096, 14336
x = torch.randn(1, K, device=dev, dtype=dtype)
g, u = (torch.randn(I, K, device=dev, dtype=dtype) * 0.02 for _ in range(2))
packed = pack_gate_up(g, u)
w = packed.weight
epi = GatedEpilogue("silu")
out = torch.empty(1, I, device=dev, dtype=dtype)
small = torch.randn(1024, device=dev, dtype=dtype)
small_out = torch.empty_like(small)


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


copy_compiled = _copy[(1,)](small, small_out, 1024, BLOCK=1024)
copy_nones = ()
dev_idx = torch.cuda.current_device()
gated_linear(x, packed)  # builds the plan
sig = dispatch._signature(x, w, None, epi, None)
plan = dispatch._PLANS[sig]
can, launch = plan[0]
fast = next(c.cell_contents for c in launch.__closure__ if type(c.cell_contents).__name__ == "FastLaunch")
compiled = next(iter(fast._compiled.values()))
print("compiled kernel:", compiled.name, "scratch", getattr(compiled.metadata, "global_scratch_size", None),
      "profile scratch", getattr(compiled.metadata, "profile_scratch_size", None),
      "cooperative", getattr(compiled.run, "launch_cooperative_grid", None), "pdl", getattr(compiled.run, "launch_pdl", None))
i, bn = I, 0
args_gemv = None
# recover launch args by a FastLaunch that records
rec = {}
orig_call = type(fast).__call__
def recording(self, grid, device_index, *args):
    rec["grid"], rec["args"] = grid, args
    return orig_call(self, grid, device_index, *args)
type(fast).__call__ = recording
launch(x, w, None, out)
type(fast).__call__ = orig_call
grid, args = rec["grid"], rec["args"]
nones = fast._nones
stream = driver.active.get_current_stream(dev_idx)
crun = compiled.run
c_launch = getattr(crun, "launch", None)
print("launcher type", type(crun), "C launch", c_launch)
import inspect
print(inspect.getsource(type(crun).__call__))


def raw_run():
    compiled.run(grid, 1, 1, driver.active.get_current_stream(dev_idx), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *nones)


def raw_run_copy():
    copy_compiled.run(1, 1, 1, driver.active.get_current_stream(dev_idx), copy_compiled.function,
                      copy_compiled.packed_metadata, None, None, None, small, small_out, 1024, None)


def c_launch_direct():
    c_launch(grid, 1, 1, stream, compiled.function, crun.launch_cooperative_grid, crun.launch_pdl, None, None,
             compiled.packed_metadata, None, None, None, *args, *nones)


rows = {
    "sync only": lambda: None,
    "torch.empty(1, I)": lambda: torch.empty((1, I), device=dev, dtype=dtype),
    "small.add(1, out=)": lambda: torch.add(small, 1, out=small_out),
    "F.linear(x, gate) [cuBLAS]": lambda: F.linear(x, g),
    "triton copy kernel, compiled.run": raw_run_copy,
    "gated gemv, compiled.run": raw_run,
    "gated gemv, FastLaunch": lambda: fast(grid, dev_idx, *args),
    "plan launcher (out given)": lambda: launch(x, w, None, out),
    "dispatch.gated_gemm (out given)": lambda: dispatch.gated_gemm(x, w, epi, None, out),
    "dispatch.gated_gemm": lambda: dispatch.gated_gemm(x, w, epi),
    "gated_linear": lambda: gated_linear(x, packed),
    "F.linear then F.linear": lambda: (F.linear(x, g), F.linear(x, g)),
    "F.linear then gemv run": lambda: (F.linear(x, g), raw_run()),
    "gemv run then F.linear": lambda: (raw_run(), F.linear(x, g)),
    "add then gemv run": lambda: (torch.add(small, 1, out=small_out), raw_run()),
}
if c_launch is not None:
    try:
        c_launch_direct(); torch.cuda.synchronize()
        rows["gated gemv, C launch direct"] = c_launch_direct
    except Exception as e:
        print("C launch direct failed:", repr(e))
samples = {k: [] for k in rows}
with torch.inference_mode():
    for fn in rows.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    keys = list(rows)
    for r in range(6):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            fn = rows[k]
            for _ in range(150):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    # back to back
    b2b = {}
    for k in ["F.linear(x, gate) [cuBLAS]", "gated gemv, compiled.run", "gated gemv, FastLaunch", "gated_linear",
              "triton copy kernel, compiled.run"] + (["gated gemv, C launch direct"] if "gated gemv, C launch direct" in rows else []):
        fn = rows[k]
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(500):
                fn()
            ts.append((time.perf_counter() - t0) / 500)
        torch.cuda.synchronize()
        b2b[k] = sorted(ts)[2] * 1e6
res = {k: (statistics.median(v) * 1e6, sorted(v)[len(v) // 10] * 1e6, sorted(v)[9 * len(v) // 10] * 1e6) for k, v in samples.items()}
for k, (m, lo, hi) in res.items():
    print(f"from idle  {k:40s} {m:7.1f} us  (p10 {lo:6.1f}, p90 {hi:6.1f})")
for k, v in b2b.items():
    print(f"back2back  {k:40s} {v:7.1f} us")
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump({"from_idle_us": res, "back_to_back_us": b2b, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__}, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_idle.json"), "w"), indent=1)
