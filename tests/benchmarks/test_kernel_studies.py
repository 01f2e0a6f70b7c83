"""The measurement tools that look inside the kernel: epilogue_cost, decode_timeline, tune_kernel's
mid-M occupancy sweep. Each builds variants of the shipped kernel; these tests check that the
variants still build against today's kernel source and compute what they claim (Triton's
interpreter on CPU, the real kernels on a GPU; inline-PTX variants only there)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_err

from swiglu_patch import pack_gate_up

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 tl.dot is wrong (FACTS.md)


def _case(m: int, k: int, i: int):
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    gate = (torch.randn(i, k, device=DEVICE) / k**0.5).to(DTYPE)
    up = (torch.randn(i, k, device=DEVICE) / k**0.5).to(DTYPE)
    return x, gate, up


@pytest.mark.parametrize("variant", ["mufu", "fdiv", "newton", "none"] if CUDA else ["fdiv", "none"])
def test_epilogue_variants_compute_what_they_claim(variant, tmp_path):
    """Each sigmoid variant, loaded as its own copy of the kernels package, runs and computes
    the MLP (or, for the `none` diagnostic, 0.5 * gate * up); the output starts as NaN."""
    from benchmarks.epilogue_cost import SIGMOIDS, load_variant
    from swiglu_patch.kernels.activations import ACTIVATIONS

    mod = load_variant(variant, SIGMOIDS[variant], tmp_path)
    assert mod.__name__ == f"_epilogue_{variant}.gated_gemm"
    m, k, i = 37, 72, 40
    x, gate, up = _case(m, k, i)
    for act in ("silu", "gelu_tanh"):
        out = torch.full((m, i), float("nan"), device=DEVICE, dtype=DTYPE)
        mod.gated_gemm(x, pack_gate_up(gate, up), act, out=out, approx_tanh=False)  # the `_sigmoid` path
        g, u = x.double() @ gate.double().T, x.double() @ up.double().T
        ref = 0.5 * g * u if variant == "none" else ACTIVATIONS[act](g) * u
        assert rel_err(out, ref) < 5e-3, (variant, act)


def test_epilogue_variant_refuses_a_changed_kernel(tmp_path, monkeypatch):
    from benchmarks import epilogue_cost

    monkeypatch.setattr(epilogue_cost, "SHIPPED_SIGMOID", "def _sigmoid(x):  # not in the file\n")
    with pytest.raises(RuntimeError, match="no longer defines _sigmoid"):
        epilogue_cost.load_variant("fdiv", epilogue_cost.SIGMOIDS["fdiv"], tmp_path)


def test_decode_timeline_traced_kernel_builds_from_todays_source(tmp_path):
    """The traced copy's three edits all find their anchor in kernels/gated_gemm.py."""
    from benchmarks.decode_timeline import traced_pointer_module

    mod = traced_pointer_module(tmp_path)
    assert "trace_ptr" in mod._gated_gemm_fwd_kernel.arg_names
    assert callable(mod._trace)


@pytest.mark.parametrize("rows,block_k,k", [(64, 32, 100), (32, 64, 64)])
def test_tile_read_kernel_reads_every_row_once(rows, block_k, k):
    """The tiled read (our tile's access pattern, no dot): per-program sums add up to the weight's."""
    import triton

    from benchmarks.decode_timeline import _tile_read_kernel

    w = torch.randn(3 * rows, k, device=DEVICE, dtype=torch.float16)
    grid = (triton.cdiv(w.shape[0], rows),)
    sums = torch.full(grid, float("nan"), device=DEVICE)
    _tile_read_kernel[grid](w, sums, sums, k, w.stride(0), TRACE=False, ROWS=rows, BLOCK_SIZE_K=block_k)
    assert torch.isfinite(sums).all()
    assert math.isclose(sums.double().sum().item(), w.double().sum().item(), rel_tol=1e-5, abs_tol=1e-3)


def test_bandwidth_by_slice_by_hand():
    """Two programs of 1 MB each: one over 0..1000 ns, one over 0..500 ns. In the first half
    of the span 1.5 MB move (3 TB/s), in the second 0.5 MB (1 TB/s)."""
    from benchmarks.decode_timeline import bandwidth_by_slice

    raw = {"start": [0, 0], "end": [1000, 500]}
    assert bandwidth_by_slice(raw, 2e6, slices=2) == pytest.approx([3.0, 1.0])


def test_report_renders_a_saved_run():
    from pathlib import Path
    import json

    from benchmarks.decode_timeline import report

    path = Path(__file__).resolve().parents[2] / "benchmarks/results/decode_timeline/decode_timeline_bfloat16.json"
    text = report(json.loads(path.read_text()), "abc1234")
    assert "| llama-3-8b | ours traced |" in text and "1/8" in text and "commit abc1234" in text


@pytest.mark.parametrize("m", [17, 24, 32, 48, 64])
def test_mid_occupancy_variants_are_mid_tiles_and_include_the_shipped_one(m):
    from benchmarks.tune_kernel import mid_occupancy_variants
    from swiglu_patch.kernels.gated_gemm import _DEFAULTS, _for_bucket

    cfgs = [kw["config"] for _, kw in mid_occupancy_variants(m)]
    assert cfgs[0] == _for_bucket(_DEFAULTS, m)
    assert all(32 <= c.block_m <= 64 for c in cfgs)
    assert len(set(cfgs)) == len(cfgs) > 1


def test_epilogue_sass_counts_the_mufu_ops_each_variant_claims():
    """`python -m benchmarks.epilogue_sass` compiles the shipped prefill tile and its variants for
    sm_90 on this machine (Triton's bundled ptxas and cuobjdump; no GPU, no interpreter: a
    subprocess without TRITON_INTERPRET) and reports the MUFU ops per thread of a tile's
    epilogue: one per output (64 outputs per thread) for the shipped tanh.approx, two for the
    exp sigmoid and its ex2/rcp and fdiv forms, one with the Newton reciprocal, none without an
    activation."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "cuobjdump").exists() or not (bin_dir / "ptxas").exists():
        pytest.skip(f"this Triton install has no bundled cuobjdump/ptxas in {bin_dir}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.epilogue_sass", "--activation", "silu"],
                         capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    mufu = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1] == "silu":
            mufu[cells[0]] = int(cells[3])
    assert mufu == {"shipped": 64, "exp": 128, "mufu": 128, "fdiv": 128, "newton": 64, "none": 0}
