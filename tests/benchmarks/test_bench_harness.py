"""CPU tests of the benchmark harness (benchmarks/): shape table, floor arithmetic, accuracy
check, render-only path, and the dry-run pipeline end to end. Seconds in all."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import bench_e2e, bench_mlp, ways
from benchmarks.accuracy import REL_ERR_BOUNDS, Reference, activation_f64, check_rows, rel_error
from benchmarks.report_mlp import GOALS, derived
from benchmarks.roofline import Peaks, floor_seconds, gated_flops, measure_peaks, min_bytes
from benchmarks.shapes import SHAPES, TOKENS, select_shapes
from benchmarks.timing import CpuTimer, GraphTimer, gpu_timer

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- shape table


def test_shape_table_holds_the_issue_models():
    # (K, I, activation) from each model's config.json, as issue 3 lists them.
    want = {
        (2048, 8192, "silu"),  # Llama-3.2-1B
        (4096, 14336, "silu"),  # Llama-3-8B / Mistral-7B
        (3584, 18944, "silu"),  # Qwen2.5-7B
        (3584, 14336, "gelu_tanh"),  # Gemma-2-9B
        (4608, 36864, "gelu_tanh"),  # Gemma-2-27B
        (8192, 28672, "silu"),  # Llama-3-70B
    }
    got = {(s.hidden, s.intermediate, s.activation) for s in SHAPES}
    assert got == want
    assert len({s.name for s in SHAPES}) == len(SHAPES)


def test_tp_shards_are_whole_packing_blocks_of_table_models():
    from benchmarks.shapes import TP_SHARD_SHAPES

    full = {(s.hidden, s.activation): s.intermediate for s in SHAPES}
    for s in TP_SHARD_SHAPES:
        tp = int(s.name.rsplit("-tp", 1)[1])
        assert full[(s.hidden, s.activation)] == s.intermediate * tp  # I / tp of a table model
        assert s.intermediate % 16 == 0  # a column shard never splits a gate/up block


def test_shape_activations_are_the_kernels():
    from swiglu_patch.kernels.epilogue import ACTIVATIONS

    assert {s.activation for s in SHAPES} <= set(ACTIVATIONS)
    assert set(ways.HF_ACT_NAMES) == set(ACTIVATIONS)


def test_tokens_are_powers_of_two_1_to_16384():
    assert list(TOKENS) == [2**e for e in range(15)]


def test_select_shapes_keeps_table_order_and_rejects_unknown():
    names = [SHAPES[3].name, SHAPES[0].name]
    assert [s.name for s in select_shapes(names)] == [SHAPES[0].name, SHAPES[3].name]
    with pytest.raises(ValueError, match="unknown shape.*known"):
        select_shapes(["llama-9000"])


# ---------------------------------------------------------------- floor arithmetic


def test_flops_and_bytes_llama3_8b_decode_by_hand():
    # M=1, K=4096, I=14336, bf16: weight 2*14336*4096 = 117,440,512 elements = 234,881,024 bytes,
    # plus x (4096) and out (14336) elements = 36,864 bytes.
    assert min_bytes(1, 4096, 14336, 2) == 234_917_888
    assert gated_flops(1, 4096, 14336) == 2 * 28672 * 4096
    # At 3 TB/s that is 78.3 us, the floor FACTS.md measured for this row.
    peaks = Peaks(matmul_tflops=700.0, copy_tbps=3.0, matmul_n=8192, copy_mib=1024)
    assert floor_seconds(gated_flops(1, 4096, 14336), 234_917_888, peaks) == pytest.approx(78.306e-6, rel=1e-4)


def test_floor_is_the_larger_bound():
    peaks = Peaks(matmul_tflops=1000.0, copy_tbps=2.0, matmul_n=1, copy_mib=1)
    # 1e12 flops at 1e15/s = 1 ms; 1e9 bytes at 2e12/s = 0.5 ms -> compute bound.
    assert floor_seconds(1e12, 1e9, peaks) == pytest.approx(1e-3)
    # 1e10 bytes = 5 ms -> memory bound.
    assert floor_seconds(1e12, 1e10, peaks) == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="positive"):
        floor_seconds(1.0, 1.0, Peaks(0.0, 1.0, 1, 1))


def test_measure_peaks_arithmetic_with_a_fixed_timer():
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 2e-3  # every call "takes" 2 ms

    p = measure_peaks(torch.device("cpu"), torch.float32, timer, matmul_n=64, copy_bytes=1 << 20)
    assert len(calls) == 2
    assert p.matmul_tflops == pytest.approx(2 * 64**3 / 2e-3 / 1e12)
    assert p.copy_tbps == pytest.approx(2 * (1 << 20) / 2e-3 / 1e12)  # read + written


# ---------------------------------------------------------------- timers


def test_gpu_timer_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown timer 'wallclock'; known: graph, do_bench"):
        gpu_timer("wallclock", 10, 40)


def test_cpu_timer_many_times_each_callable():
    calls = {"a": 0, "b": 0}

    def bump(key):
        calls[key] += 1

    out = CpuTimer(reps=3).many({"a": lambda: bump("a"), "b": lambda: bump("b")})
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert calls == {"a": 4, "b": 4}  # one warm-up + 3 timed each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GraphTimer captures CUDA graphs: needs a GPU")
def test_graph_timer_captures_and_falls_back_for_a_host_sync():
    timer = GraphTimer(warmup_ms=1, rep_ms=5, rounds=2)
    a = torch.randn(2048, 2048, device="cuda")
    t = timer.many({"mm": lambda: a @ a, "sync": lambda: (a @ a).sum().item()})
    assert timer.modes["mm"] == "graph" and timer.modes["sync"].startswith("eager (host sync")
    # a 2048^3 fp32 matmul: 17 GFLOP, between 10 us and 10 ms on any GPU this runs on
    assert 1e-5 < t["mm"] < 1e-2 and t["sync"] > 0
    torch.randn(4, device="cuda")  # the process's CUDA generator still works: no capture was tried


def test_decode_fit_recovers_bandwidth_and_fixed_cost():
    from benchmarks.summarize_mlp import decode_fit

    rows = []
    for k, i in [(2048, 8192), (4096, 14336), (8192, 28672)]:
        weight = 2 * i * k * 2  # bf16
        us = weight / 3.0e12 * 1e6 + 7.0  # 3 TB/s plus 7 µs per call
        rows.append({"dtype": "bfloat16", "M": 1, "K": k, "I": i, "min_bytes": min_bytes(1, k, i, 2),
                     "ways": {"ours": {"status": "ok", "us": us}, "gemm_only": {"status": "failed"}}})
    tbps, fixed = decode_fit(rows, "ours", "bfloat16")
    assert tbps == pytest.approx(3.0, rel=1e-9) and fixed == pytest.approx(7.0, rel=1e-9)
    assert decode_fit(rows, "gemm_only", "bfloat16") is None  # no timed rows


# ---------------------------------------------------------------- accuracy check


@pytest.mark.parametrize("activation,torch_fn", [
    ("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh")), ("gelu", F.gelu)])
def test_activation_formulas_match_torch(activation, torch_fn):
    g = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    torch.testing.assert_close(activation_f64(g, activation), torch_fn(g), rtol=1e-12, atol=1e-12)


def test_check_rows_first_last_unique():
    rows = check_rows(1000, 8, torch.Generator().manual_seed(0))
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 8 and len(set(rows.tolist())) == 8
    assert check_rows(3, 8).tolist() == [0, 1, 2]


def test_rel_error_separates_right_from_wrong():
    torch.manual_seed(0)
    k, i = 64, 48
    gate, up = torch.randn(i, k) / k**0.5, torch.randn(i, k) / k**0.5
    x = torch.randn(5, k)
    ref = Reference(gate, up, "silu")
    bf16 = (F.silu(x.bfloat16() @ gate.bfloat16().T) * (x.bfloat16() @ up.bfloat16().T))
    swapped = F.silu(x @ up.T) * (x @ gate.T)  # gate and up confused: a layout bug
    bound = REL_ERR_BOUNDS[torch.bfloat16]
    assert rel_error(bf16, ref.gated(x)) < bound / 2
    assert rel_error(swapped, ref.gated(x)) > 10 * bound
    assert rel_error(bf16[:, :-1], ref.gated(x)) == math.inf  # wrong shape
    assert ref.preact(x).shape == (5, 2 * i)


# ---------------------------------------------------------------- render-only path


def _row(shape, k, i, m, floor_us, **us):
    ways_ = {}
    for w in ways.WAY_NAMES:
        v = us.get(w)
        if v is None:
            ways_[w] = {"status": "skipped", "reason": f"{w} not here"}
        elif v == "fail":
            ways_[w] = {"status": "failed", "rel_err": 0.5, "reason": "relative error 5.0e-01 > bound"}
        else:
            ways_[w] = {"status": "ok", "us": v, "rel_err": 1e-3}
    return {"dtype": "bfloat16", "shape": shape, "M": m, "K": k, "I": i, "activation": "silu",
            "flops": gated_flops(m, k, i), "min_bytes": min_bytes(m, k, i, 2), "floor_us": floor_us, "ways": ways_}


def synthetic_results() -> dict:
    return {
        "schema": 1, "kind": "bench_mlp",
        "env": {"gpu": {"name": "Fake GPU", "driver": "1.0"}, "versions": {"torch": "x"},
                "git": {"commit": "deadbeef", "source": "argument", "dirty": None}, "date_utc": "2026-01-01"},
        "settings": {"timer": "fake", "rel_err_bounds": {"bfloat16": 0.016}},
        "shapes": [{"name": "b", "models": "Model B", "hidden": 64, "intermediate": 32, "activation": "silu"},
                   {"name": "a", "models": "Model A", "hidden": 64, "intermediate": 32, "activation": "silu"}],
        "ways": list(ways.WAY_NAMES),
        "ms": [1, 512],
        "peaks": {"bfloat16": {"matmul_tflops": 700.0, "copy_tbps": 3.0, "matmul_n": 8192, "copy_mib": 1024}},
        "rows": [
            # decode: floor 80 / ours 100 = 0.80 (missed); best other = torch_compile 110 -> 100/110
            _row("b", 64, 32, 1, 80.0, ours=100.0, gemm_only=90.0, hf_eager=120.0, torch_compile=110.0),
            # prefill: ours 90 / gemm 100 = 0.90 (met); liger failed, so best other = hf_eager 95
            _row("b", 64, 32, 512, 50.0, ours=90.0, gemm_only=100.0, hf_eager=95.0, liger="fail"),
            _row("a", 64, 32, 1, 95.0, ours=100.0, gemm_only=99.0, hf_eager=101.0),
        ],
    }


def test_derived_ratios_by_hand():
    data = synthetic_results()
    d = derived(data["rows"][0])
    assert d["ours_over_gemm"] == pytest.approx(100 / 90)
    assert d["best_other"] == "torch_compile" and d["ours_over_best"] == pytest.approx(100 / 110)
    assert d["floor_frac"] == pytest.approx(0.80)
    assert d["ours_tflops"] == pytest.approx(2 * 1 * 64 * 64 / 100e-6 / 1e12)
    d = derived(data["rows"][1])
    assert d["best_other"] == "hf_eager"  # liger failed: not a comparator; gemm_only never is


def test_goals_verdicts_by_hand():
    rows = synthetic_results()["rows"]
    by_key = {g.key: g for g in GOALS}
    assert by_key["decode_floor"].judge(rows[0]) == ("missed", pytest.approx(0.80))
    assert by_key["decode_floor"].judge(rows[2]) == ("met", pytest.approx(0.95))
    assert by_key["decode_floor"].judge(rows[1])[0] == ""  # M=512: does not apply
    assert by_key["prefill_vs_gemm"].judge(rows[1]) == ("met", pytest.approx(0.90))
    assert by_key["vs_best_other"].judge(rows[1]) == ("met", pytest.approx(90 / 95))
    assert by_key["vs_best_other"].judge(rows[2]) == ("met", pytest.approx(100 / 101))
    slow = dict(rows[2], ways={**rows[2]["ways"], "ours": {"status": "ok", "us": 104.0}})
    assert by_key["vs_best_other"].judge(slow) == ("missed", pytest.approx(104 / 101))  # > 1.02
    assert by_key["prefill_vs_gemm"].judge(dict(rows[1], ways={**rows[1]["ways"], "ours": {"status": "failed"}})) \
        == ("n/a", None)


def test_render_only_rebuilds_markdown_and_png(tmp_path):
    src = tmp_path / "in" / "results.json"
    src.parent.mkdir()
    src.write_text(json.dumps(synthetic_results()))
    assert bench_mlp.main(["--render", str(src), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "results.md").read_text()
    png = (tmp_path / "out" / "mlp_bfloat16.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "Fake GPU" in md and "deadbeef" in md
    assert md.index("### Model B") < md.index("### Model A")  # the shape table's order
    assert "| 512 | 90.0 | 100.0 | 95.0 | n/a | FAIL (err 5.0e-01) | 50.0 | 0.900 | 0.947 (hf_eager) | 0.56 |" in md
    assert "missed 0.800" in md and "met 0.900" in md
    assert "M <= 16: floor / ours >= 0.92: met in 1 of 2 rows" in md
    # without --out, the JSON's own folder
    assert bench_mlp.main(["--render", str(src)]) == 0
    assert (src.parent / "results.md").read_text() == md


def test_render_merges_runs(tmp_path):
    bf16 = synthetic_results()
    bf16["rows"][2]["ways"] = {w: {"status": "skipped", "reason": "out of --budget-s"} for w in ways.WAY_NAMES}
    rerun = synthetic_results()  # the row cut by the budget, measured in a second call
    rerun["rows"] = [synthetic_results()["rows"][2]]
    rerun["env"]["git"]["commit"] = "cafe"
    fp16 = json.loads(json.dumps(synthetic_results()).replace("bfloat16", "float16"))
    paths = []
    for n, run in enumerate([bf16, rerun, fp16]):
        paths.append(tmp_path / f"{n}.json")
        paths[-1].write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="--out"):
        bench_mlp.main(["--render", *map(str, paths)])
    assert bench_mlp.main(["--render", *map(str, paths), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert len(merged["rows"]) == 6 and set(merged["peaks"]) == {"bfloat16", "float16"}
    row = next(r for r in merged["rows"] if (r["dtype"], r["shape"], r["M"]) == ("bfloat16", "a", 1))
    assert row["ways"]["ours"]["status"] == "ok"
    md = (tmp_path / "m" / "results.md").read_text()
    assert "## bfloat16" in md and "## float16" in md and "deadbeef + cafe" in md
    assert (tmp_path / "m" / "mlp_float16.png").exists()


# ---------------------------------------------------------------- dry run, end to end


def test_dry_run_pipeline(tmp_path):
    assert bench_mlp.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0", "--commit", "abc123"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["env"]["git"] == {"commit": "abc123", "source": "argument", "dirty": data["env"]["git"]["dirty"]}
    assert len(data["rows"]) == 2 * 3  # dry-run shapes x Ms
    bound = data["settings"]["rel_err_bounds"]["bfloat16"]
    for row in data["rows"]:
        for way in ("ours", "gemm_only", "hf_eager"):
            w = row["ways"][way]
            assert w["status"] == "ok", (row["shape"], row["M"], way, w)
            assert 0 < w["rel_err"] < bound and w["us"] > 0
        assert row["floor_us"] > 0
    assert (tmp_path / "results.md").exists() and (tmp_path / "mlp_bfloat16.png").exists()


def test_a_wrong_way_is_flagged_and_not_timed(tmp_path, monkeypatch):
    real_build = ways.build

    def build(way, ops, compiled=None):
        fn = real_build(way, ops, compiled)
        if way == "ours":  # a kernel that gets the gate/up layout wrong
            return lambda: F.silu(ops.x @ ops.up.T) * (ops.x @ ops.gate.T)
        return fn

    monkeypatch.setattr(bench_mlp, "build", build)
    assert bench_mlp.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0", "--ms", "5"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    for row in data["rows"]:
        assert row["ways"]["ours"]["status"] == "failed" and "us" not in row["ways"]["ours"]
        assert row["ways"]["hf_eager"]["status"] == "ok"
    assert "FAIL (err" in (tmp_path / "results.md").read_text()


def test_budget_skips_rows_but_still_reports(tmp_path):
    assert bench_mlp.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "1e-9"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(w["status"] == "skipped" and "budget" in w["reason"] for r in data["rows"] for w in r["ways"].values())
    assert "out of --budget-s" in (tmp_path / "results.md").read_text()


def test_importing_benchmarks_pulls_no_optional_dependency():
    code = ("import sys, benchmarks.bench_mlp, benchmarks.bench_e2e; "
            "bad = [m for m in ('liger_kernel', 'lm_eval', 'matplotlib') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_e2e_dry_run_and_render(tmp_path):
    assert bench_e2e.main(["--dry-run", "--out", str(tmp_path), "--reps", "1"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["model"]["layers"] == 2 and "patched 2 MLP" in data["patch_report"]
    for mode in ("eager", "patched"):
        assert [p["prompt"] for p in data[mode]["prefill"]] == [16, 32]
        assert all(d["generated"] == d["new_tokens"] for d in data[mode]["decode"])  # min_new_tokens held
        assert [(g["batch"], len(g["tokens"])) for g in data[mode]["decode_graph"]] == [(1, 4), (2, 4)]
        assert all(g["step_ms"] > 0 for g in data[mode]["decode_graph"])
    assert data["agreement"]["top1_agree"] > 0.5
    md = (tmp_path / "results.md").read_text()
    (tmp_path / "results.md").unlink()
    assert bench_e2e.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: times the real kernel")
def test_gpu_quick_run(tmp_path):
    assert bench_mlp.main(["--out", str(tmp_path), "--shapes", "llama-3.2-1b", "--ms", "1", "512",
                           "--ways", "ours", "gemm_only", "hf_eager", "--warmup-ms", "2", "--rep-ms", "5"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(r["ways"][w]["status"] == "ok" for r in data["rows"] for w in ("ours", "gemm_only", "hf_eager"))


def test_run_to_run_spread_by_hand():
    """summarize_mlp --compare: per-way ratios of the rows two runs share at M >= 512."""
    from benchmarks.summarize_mlp import run_to_run

    def row(m, ours, gemm, shape="a"):
        return {"dtype": "bfloat16", "shape": shape, "M": m,
                "ways": {"ours": {"status": "ok", "us": ours}, "gemm_only": {"status": "ok", "us": gemm}}}

    old = [row(512, 10.0, 10.0), row(1024, 20.0, 20.0), row(16, 5.0, 5.0), row(2048, 1.0, 1.0, shape="gone")]
    new = [row(512, 11.0, 10.0), row(1024, 19.0, 20.0), row(16, 50.0, 5.0)]
    assert run_to_run(new, old, "ours") == pytest.approx((1.025, 0.95, 1.1))  # median of two
    assert run_to_run(new, old, "gemm_only") == pytest.approx((1.0, 1.0, 1.0))
    assert run_to_run(new, [], "ours") is None
