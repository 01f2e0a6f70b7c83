"""benchmarks/bench_e2e.py on CPU: the dry run exercises every part (prefill, generate with a
dynamic and a static cache, the uncaptured graph decode, host time per MLP call, the profiled
decode step) on a tiny model
of each shape, the report renders from the JSON alone, and bad arguments are one-line errors."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_e2e

SMALL = ["--batches", "1", "--rounds", "2", "--prefill", "16", "--new-tokens", "3", "--host-calls", "4"]


def _dry_run(tmp_path, *extra) -> dict:
    assert bench_e2e.main(["--dry-run", "--out", str(tmp_path), "--commit", "abc123", *SMALL, *extra]) == 0
    return json.loads((tmp_path / "results.json").read_text())


def test_dry_run_exercises_every_part_and_renders(tmp_path):
    data = _dry_run(tmp_path)
    assert data["kind"] == "bench_e2e" and data["env"]["git"]["commit"] == "abc123"
    assert data["model"]["layers"] == 2 and "patched 2 MLP" in data["patch_report"]
    assert [p["prompt"] for p in data["prefill"]] == [16]
    assert [(g["cache"], g["batch"]) for g in data["generate"]] == [("dynamic", 1), ("static", 1)]
    for part in ("prefill", "generate", "graph"):
        for row in data[part]:
            for mode in ("eager", "patched"):
                assert len(row[mode]["rounds_s"]) == 2 and row[mode]["per_s"] > 0
            s = row["speedup"]
            assert len(s["rounds"]) == 2 and s["min"] <= s["median"] <= s["max"]
            assert s["rounds"][0] == pytest.approx(row["eager"]["rounds_s"][0] / row["patched"]["rounds_s"][0])
    for g in data["generate"]:
        assert all(len(t) == 3 for t in g["tokens"].values())  # min_new_tokens held
        assert g["compiled"] is False  # transformers compiles a static cache's forward on CUDA only
    assert [len(g["tokens"]["eager"]) for g in data["graph"]] == [3]
    host = data["host"][0]
    assert host["batch"] == 1 and host["eager"]["calls"] == 4 and host["patched"]["median_us"] > 0
    profiled = {(r["cache"], r["batch"]): r for r in data["profile"]}
    assert set(profiled) == {("dynamic", 1), ("static", 1)}
    for mode in ("eager", "patched"):
        dynamic, static = profiled["dynamic", 1][mode], profiled["static", 1][mode]
        assert dynamic["mlp_calls"] == 2 * 3  # every layer's MLP once per forward: the prompt, then 2 steps
        assert 0 < dynamic["mlp_host_ms"] < dynamic["wall_ms"]
        assert dynamic["gpu_ms"] is None and static["mlp_calls"] == 0 and static["mlp_host_ms"] is None
    assert data["agreement"]["top1_agree"] > 0.5
    assert [g["cache"] for g in data["agreement"]["generate_leading_tokens"]] == ["dynamic", "static"]
    for g in data["generate"]:  # the first position where each sequence's tokens differ, or all equal
        assert len(g["equal_leading"]) == g["batch"] and all(0 <= n <= 3 for n in g["equal_leading"])
    md = (tmp_path / "results.md").read_text()
    for heading in ("## Prefill", "## HF generate", "## Decode, the step captured", "## Host time per MLP call",
                    "## Where a decode step's time goes", "## Agreement"):
        assert heading in md
    assert "| static | 1 |" in md and "dry run on CPU" in md and "abc123" in md
    (tmp_path / "results.md").unlink()
    assert bench_e2e.main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md


def test_dry_run_of_the_qwen_shape(tmp_path):
    data = _dry_run(tmp_path, "--shape", "qwen2.5-7b", "--rounds", "1", "--parts", "generate", "host")
    assert data["model"]["model_type"] == "qwen2" and "prefill" not in data and "graph" not in data
    assert [g["cache"] for g in data["generate"]] == ["dynamic", "static"] and data["host"]


def test_parts_and_caches_narrow_the_run(tmp_path):
    data = _dry_run(tmp_path, "--rounds", "1", "--parts", "generate", "--cache", "static")
    assert [g["cache"] for g in data["generate"]] == ["static"]
    assert not {"prefill", "graph", "host"} & set(data)
    md = (tmp_path / "results.md").read_text()
    assert "## HF generate" in md and "## Prefill" not in md


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X", "--shape", "llama-9000"], "invalid choice: 'llama-9000'"),
    (["--dry-run", "--out", "X", "--cache", "paged"], "invalid choice: 'paged'"),
    (["--dry-run", "--out", "X", "--batches", "0"], "expected an integer >= 1, got '0'"),
    (["--dry-run", "--out", "X", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--out", "X", "--layers", "40"], "--layers 40: Llama-3-8B has 32"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_render_refuses_another_schema(tmp_path, capsys):
    (tmp_path / "old.json").write_text(json.dumps({"kind": "bench_e2e", "schema": 1}))
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(["--render", str(tmp_path / "old.json")])
    assert e.value.code == 2 and "schema 2" in capsys.readouterr().err


@pytest.mark.parametrize("name, family", [
    ("_gated_gemv_kernel", "fused"),  # ours, although it names a GEMV
    ("_gated_gemm_tma_kernel", "fused"),
    ("_experts_gated_gemm_kernel", "fused"),  # the MoE experts kernels are ours too
    ("_expert_blocks_kernel", "fused"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>", "gemm"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),  # CUTLASS-built, but attention
    ("triton_poi_fused_mul_silu_0", "triton"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "triton"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
])
def test_kernel_family_by_name(name, family):
    from benchmarks.harness.step_profile import kernel_family

    assert kernel_family(name) == family


def test_per_step_divides_every_millisecond_figure():
    got = bench_e2e._per_step({"wall_ms": 30.0, "gpu_ms": None, "family_gpu_ms": {"gemm": 6.0, "fused": 3.0},
                               "gpu_busy": 0.5, "mlp_calls": 9}, 3)
    assert got == {"wall_ms": 10.0, "gpu_ms": None, "family_gpu_ms": {"gemm": 2.0, "fused": 1.0},
                   "gpu_busy": 0.5, "mlp_calls": 9}


def test_families_table_and_the_step_bound():
    from benchmarks.harness.report_e2e import _families, step_bound

    assert step_bound(3.0, 0.06) == pytest.approx(3.0 / 2.94)
    fam = {"eager": {"fused": 0.0, "gemm": 2.0, "attention": 0.3, "triton": 0.2, "other": 0.1},
           "patched": {"fused": 0.5, "gemm": 1.44, "attention": 0.3, "triton": 0.1, "other": 0.1}}
    profile = [{
        "cache": "static", "batch": 8,
        **{m: {"wall_ms": 3.2 if m == "eager" else 3.1, "gpu_ms": sum(f.values()), "family_gpu_ms": f}
           for m, f in fam.items()}}]
    generate = [{"cache": "static", "batch": 8, "new_tokens": 100, "eager": {"median_s": 0.3}}]
    md = "\n".join(_families({"profile": profile, "generate": generate}))
    assert "| static | 8 | eager | 0.000 | 2.000 | 0.300 | 0.200 | 0.100 | 0.60 |" in md
    assert "| static | 8 | patched | 0.500 | 1.440 | 0.300 | 0.100 | 0.100 | 0.66 |" in md
    saved = 2.6 - 2.44  # ms per step
    assert f"| static | 8 | 160 | 3.000 | {3.0 / (3.0 - saved):.3f}x |" in md
    assert _families({"profile": [{"cache": "dynamic", "batch": 1, "eager": {"family_gpu_ms": None}}]}) == []
