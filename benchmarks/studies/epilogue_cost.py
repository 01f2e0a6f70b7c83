"""What the activation costs the prefill kernel: the shipped epilogue against variants of its sigmoid.

At prefill the TMA kernel's MMAs stop while a tile's epilogue runs (the same warps run both),
so the activation's instructions add to every tile's time. On a 128x(2x128) tile each of
the 256 threads of the two consumer warpgroups evaluates act(gate) * up for 64 outputs;
MUFU ops run 16 per clock per SM on sm_90, so two per output cost 2048 clocks per tile.
This script times, in one interleaved run against cuBLAS (`gemm_only`), the same kernel with
its activation written as

- `shipped`: the current code; for 16-bit inputs silu and gelu_tanh take one
  `tanh.approx.f32` per output (g/2 + g/2 * tanh(.)): 1 MUFU, about 580 instructions per
  thread by the sm_90 SASS of Triton 3.6 (`epilogue_sass.py`);
- `exp`: the shipped kernel with `approx_tanh=False`: sigmoid as `1 / (1 + exp(-x))`, the
  code shipped before 2026-11-22's session six: 2 MUFU, about 1180 instructions;
- `mufu`: that sigmoid with `ex2.approx.ftz` and `rcp.approx.ftz` by inline PTX: no denormal
  fix-ups, 2 MUFU;
- `fdiv`: `tl.exp2` and `tl.fdiv(ieee_rounding=False)`;
- `newton`: `ex2.approx.ftz` then a 3-step Newton reciprocal on the FMA pipe: 1 MUFU;
- `none`: sigmoid replaced by 0.5, so out = 0.5 * gate * up: the epilogue without an
  activation, a diagnostic that bounds what any activation code can win (checked against
  0.5 * gate * up, not against the MLP).

`mufu`, `fdiv`, `newton` and `none` are copies of the installed `kernels` package with
`_sigmoid` replaced, imported under their own names and run with `approx_tanh=False`; every
way but `none` is checked against float64 on sampled rows before it is timed.

    python -m benchmarks.epilogue_cost --out $OUT/epilogue --commit <sha> [--shapes ...] [--tokens 512 2048 8192]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.env_info import environment
from benchmarks.shapes import SHAPES, select_shapes
from benchmarks.timing import GraphTimer
from benchmarks.tune_kernel import rel_err_rows
from swiglu_patch import pack_gate_up
from swiglu_patch.kernels import gated_gemm as shipped_module

SHIPPED_SIGMOID = '''@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
'''
_PTX = '''@triton.jit
def _ex2_ftz(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rcp_approx(x):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


'''
SIGMOIDS = {
    "mufu": _PTX + '''@triton.jit
def _sigmoid(x):
    return _rcp_approx(1.0 + _ex2_ftz(x * -1.4426950408889634))
''',
    "fdiv": '''@triton.jit
def _sigmoid(x):
    return tl.fdiv(1.0, 1.0 + tl.exp2(x * -1.4426950408889634), ieee_rounding=False)
''',
    "newton": _PTX + '''@triton.jit
def _sigmoid(x):
    y = 1.0 + _ex2_ftz(tl.minimum(x * -1.4426950408889634, 125.0))  # 1 <= y <= 2^125 + 1
    r = (0x7EF311C3 - y.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 1/y to ~12%
    r = r * (2.0 - y * r)
    r = r * (2.0 - y * r)
    r = r * (2.0 - y * r)
    return r
''',
    "none": '''@triton.jit
def _sigmoid(x):
    return 0.5
''',
}


def load_variant(name: str, sigmoid_src: str, root: Path):
    """The `gated_gemm` module of a copy of the kernels package whose `_sigmoid` is `sigmoid_src`."""
    src = Path(shipped_module.__file__).parent
    pkg = f"_epilogue_{name}"
    dst = root / pkg
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    path = dst / "gated_gemm.py"
    text = path.read_text()
    if SHIPPED_SIGMOID not in text:
        raise RuntimeError("epilogue_cost: kernels/gated_gemm.py no longer defines _sigmoid as this script expects")
    path.write_text(text.replace(SHIPPED_SIGMOID, sigmoid_src))
    spec = importlib.util.spec_from_file_location(pkg, dst / "__init__.py", submodule_search_locations=[str(dst)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{pkg}.gated_gemm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--tokens", nargs="*", type=int, default=[512, 2048, 8192])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", nargs="*", default=list(SIGMOIDS), choices=list(SIGMOIDS))
    ap.add_argument("--rep-ms", type=float, default=30)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/epilogue"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    timer = GraphTimer(warmup_ms=5, rep_ms=args.rep_ms, rounds=4)
    tmp = Path(tempfile.mkdtemp(prefix="epilogue_cost_"))
    # way -> (gated_gemm module, approx_tanh argument)
    ways = {"shipped": (shipped_module, None), "exp": (shipped_module, False)}
    ways |= {v: (load_variant(v, SIGMOIDS[v], tmp), False) for v in args.variants}
    rows = []
    for shape in select_shapes(args.shapes, SHAPES):
        k, i = shape.hidden, shape.intermediate
        gate = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        up = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        stacked, packed = torch.cat([gate, up]), pack_gate_up(gate, up)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda").to(dtype)
            sample = torch.randperm(m, device="cuda")[:64]
            fns, errs = {"gemm_only": lambda: x @ stacked.T}, {}
            for name, (mod, approx) in ways.items():
                out = torch.full((m, i), float("nan"), dtype=dtype, device="cuda")
                mod.gated_gemm(x, packed, shape.activation, out=out, approx_tanh=approx)
                if name == "none":  # out = 0.5 * gate * up
                    xr = x[sample].double()
                    ref = 0.5 * (xr @ gate.double().T) * (xr @ up.double().T)
                    err = ((out[sample].double() - ref).norm() / ref.norm()).item()
                else:
                    err = rel_err_rows(out, x, gate, up, shape.activation, sample)
                if not (math.isfinite(err) and err < 1e-2 and not out.isnan().any().item()):
                    raise RuntimeError(f"epilogue_cost: {name} on {shape.name} M={m}: rel err {err:.3g}")
                errs[name] = err
                fns[name] = (lambda mod=mod, out=out, approx=approx:
                             mod.gated_gemm(x, packed, shape.activation, out=out, approx_tanh=approx))
            secs = timer.many(fns)
            row = dict(shape=shape.name, activation=shape.activation, K=k, I=i, M=m,
                       gemm_only_us=secs["gemm_only"] * 1e6,
                       us={n: secs[n] * 1e6 for n in ways}, rel_err=errs,
                       ratio={n: secs[n] / secs["gemm_only"] for n in ways})
            rows.append(row)
            print(f"{shape.name:14s} M={m:6d} gemm_only {row['gemm_only_us']:8.1f} us  "
                  + "  ".join(f"{n} {r:.3f}" for n, r in row["ratio"].items()), flush=True)
    env = environment(torch.device("cuda"), args.commit) | dict(dtype=args.dtype, timer=timer.describe())
    (args.out / f"epilogue_cost_{args.dtype}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    names = list(ways)
    lines = [f"# Epilogue cost at prefill ({env['gpu']['name']}, {args.dtype}, commit {args.commit})", "",
             f"Time / cuBLAS `gemm_only` in one interleaved run; timer: {timer.describe()}", "",
             "| shape | M | gemm_only µs | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['M']} | {r['gemm_only_us']:.1f} | "
                     + " | ".join(f"{r['ratio'][n]:.3f}" for n in names) + " |")
    lines += ["", "Geometric mean over rows: "
              + ", ".join(f"{n} {math.exp(sum(math.log(r['ratio'][n]) for r in rows) / len(rows)):.3f}" for n in names)]
    lines += ["", "Largest rel err vs float64 (sampled rows): "
              + ", ".join(f"{n} {max(r['rel_err'][n] for r in rows):.2e}" for n in names)]
    (args.out / f"epilogue_cost_{args.dtype}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))


if __name__ == "__main__":
    main()
