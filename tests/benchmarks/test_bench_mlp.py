"""benchmarks/bench_mlp.py on CPU: derived ratios and goals, the render-only path and merging
runs, the dry-run pipeline end to end, a wrong way flagged, the time budget, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import bench_mlp
from benchmarks.harness import ways
from benchmarks.harness.report_mlp import GOALS, derived
from benchmarks.harness.roofline import gated_flops, min_bytes

REPO = Path(__file__).resolve().parents[2]



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
    with pytest.raises(SystemExit) as e:
        bench_mlp.main(["--render", *map(str, paths)])
    assert e.value.code == 2
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
    code = ("import sys, benchmarks.bench_mlp, benchmarks.bench_e2e, benchmarks.bench_host, benchmarks.tune, "
            "benchmarks.summarize; "
            "bad = [m for m in ('liger_kernel', 'lm_eval', 'matplotlib') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: times the real kernel")
def test_gpu_quick_run(tmp_path):
    assert bench_mlp.main(["--out", str(tmp_path), "--shapes", "llama-3.2-1b", "--ms", "1", "512",
                           "--ways", "ours", "gemm_only", "hf_eager", "--warmup-ms", "2", "--rep-ms", "5"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(r["ways"][w]["status"] == "ok" for r in data["rows"] for w in ("ours", "gemm_only", "hf_eager"))




@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X", "--shapes", "llama-9000"], "unknown shape(s) llama-9000"),
    (["--dry-run", "--out", "X", "--dtype", "int8"], "unknown --dtype int8"),
    (["--dry-run", "--out", "X", "--ways", "fastest"], "unknown --ways"),
    (["--dry-run", "--out", "X", "--ms", "0"], "--ms must be positive"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench_mlp.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU machine gives")
def test_measuring_without_a_gpu_says_what_to_do(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench_mlp.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
