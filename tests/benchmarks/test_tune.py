"""benchmarks/tune.py: every sweep's candidates (harness/sweep_candidates.py) are configs their kernel
takes, the dry run checks and times candidates in Triton's interpreter against the shipped rule, the
per-bucket pick by hand."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import tune
from benchmarks.harness import sweep_candidates
from benchmarks.harness.shapes import SHAPES, TP_SHARD_SHAPES
from swiglu_patch.kernels import (dispatch, gated_gemm_pointer, gated_gemm_tma, gated_gemm_tma_grid, gated_gemv)
from swiglu_patch.kernels.device import interpreting
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.rules import BACKWARD_KERNELS, KERNELS

MODULES = {"pointer": gated_gemm_pointer, "tma": gated_gemm_tma, "grid": gated_gemm_tma_grid, "gemv": gated_gemv}

SWEEP_TOKENS = {"buckets": [1, 32, 64, 128, 512, 8192], "decode": [1, 16], "gemv": [1], "grid": [2, 32, 64, 128],
                "tail": [256, 2048], "midocc": [32, 64], "paired": [64, 512], "backward": [4096], "backward_variants": [4096],
                "backward_ws": [4096],
                "preact": [4096]}
# The dry run and these checks run the kernels on CPU tensors: Triton's interpreter (a GPU machine runs the sweeps).
on_the_interpreter = pytest.mark.skipif(not interpreting(), reason="the dry run is the CPU interpreter's")


def _shipped(k, i):
    def shipped(kernel, at_m):
        key = dispatch.CallKey("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16, at_m, k, i, False)
        return next((r.config for _, r in dispatch.candidates(key) if r.kernel == kernel), None)

    return shipped


@pytest.mark.parametrize("sweep", sorted(sweep_candidates.SWEEPS))
def test_every_candidate_is_a_config_its_kernel_takes(sweep):
    assert set(SWEEP_TOKENS) == set(sweep_candidates.SWEEPS)
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), APPROX_TANH=False)
    for shape in SHAPES + TP_SHARD_SHAPES:
        for m in SWEEP_TOKENS[sweep]:
            cands = [(k, c) for k, c in sweep_candidates.SWEEPS[sweep](m, shape.hidden, shape.intermediate,
                                                                      _shipped(shape.hidden, shape.intermediate)) if c]
            assert cands, (sweep, shape.name, m)
            labels = [sweep_candidates.label(k, c) for k, c in cands]
            assert len(labels) == len(set(labels)), (sweep, m, labels)
            for kernel, config in cands:
                if sweep_candidates.OP.get(sweep) == "backward":
                    assert kernel in BACKWARD_KERNELS
                    dispatch.MODULES[kernel].make_launcher(config, epilogue, torch.bfloat16)  # raises if refused
                    continue
                assert kernel in KERNELS
                MODULES[kernel].make_launcher(config, epilogue, False, torch.bfloat16,
                                              **({"store_preact": True} if sweep == "preact" else {}))
                assert config.block_n % 16 == 0 or kernel == "pointer"  # whole gate/up blocks per TMA box / GEMV


@on_the_interpreter
def test_dry_run_checks_and_times_against_the_shipped_rule(tmp_path):
    assert tune.main(["--dry-run", "--out", str(tmp_path), "--sweep", "decode", "--commit", "abc123"]) == 0
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["kind"] == "tune" and data["sweep"] == "decode" and data["dtype"] == "float16"
    assert data["env"]["git"]["commit"] == "abc123" and data["env"]["triton_interpret"] == "1"
    rows = data["rows"]
    assert {(r["shape"], r["m"]) for r in rows} == {(s, m) for s in ("tiny-silu", "tiny-gelu-tanh") for m in (1, 7)}
    shipped = [r for r in rows if r["role"] == "shipped"]
    assert len(shipped) == 4 and all(r["status"] == "ok" and r["label"].startswith("shipped: rule ") for r in shipped)
    timed = [r for r in rows if r["role"] == "candidate" and r["status"] == "ok"]
    assert timed and all(r["ratio"] > 0 and r["rel_err"] < 2e-3 for r in timed)
    assert all(r["config"]["block_m"] == 16 for r in timed)
    md = (tmp_path / "tune.md").read_text()
    assert "# Sweep `decode` (float16)" in md and "bucket 1:" in md and "bucket 8:" in md


@on_the_interpreter
@pytest.mark.parametrize("sweep", ["backward", "backward_variants", "preact"])
def test_the_training_sweeps_check_both_outputs_against_float64(tmp_path, sweep):
    assert tune.main(["--dry-run", "--out", str(tmp_path), "--sweep", sweep, "--tokens", "7", "33",
                      "--shapes", "tiny-silu"]) == 0
    data = json.loads((tmp_path / "tune.json").read_text())
    rows = data["rows"]
    assert {r["op"] for r in rows} == {sweep_candidates.OP[sweep]} and {r["m"] for r in rows} == {7, 33}
    if sweep == "backward_variants":  # the TMA kernels are skipped on CPU; the split kernel runs
        assert {r["kernel"] for r in rows if r["status"] == "ok"} >= {"backward_split"}
        assert isinstance(data["compiled"], list)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["role"] for r in ok} == {"shipped", "candidate"}, rows
    assert all(r["ratio"] > 0 and r["rel_err"] < 2e-3 for r in ok)


@on_the_interpreter
def test_a_wrong_output_fails_the_check():
    from benchmarks.harness.accuracy import Reference
    from benchmarks.harness.sweep_ops import build_op
    from swiglu_patch import pack_gate_up

    gen = torch.Generator().manual_seed(0)
    gate, up, x = torch.randn(40, 32, generator=gen), torch.randn(40, 32, generator=gen), torch.randn(9, 32, generator=gen)
    stacked = torch.cat([gate, up])
    for name in ("forward", "preact", "backward"):
        op = build_op(name, x, pack_gate_up(gate, up).weight, stacked, "silu", Reference(gate, up, "silu").gated,
                      torch.arange(9), gen)
        fn, outs = op.make("pointer" if name != "backward" else "backward_pointer", None)
        fn()
        assert op.error(outs) < 1e-5, name
        outs[-1][3].mul_(1.01)  # one row of the last output 1% off
        assert 1e-4 < op.error(outs) < 1.0, name


@on_the_interpreter
def test_gemv_needs_whole_blocks_and_is_recorded_not_timed(tmp_path):
    # tiny-gelu-tanh has I = 40: not whole 16-row blocks, so the GEMV refuses it with the fix in its error
    assert tune.main(["--dry-run", "--out", str(tmp_path), "--sweep", "gemv", "--tokens", "1",
                      "--shapes", "tiny-gelu-tanh"]) == 0
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    gemv = [r for r in rows if r["kernel"] == "gemv"]
    assert gemv and all(r["status"] == "error" and "I % 16 == 0" in r["reason"] for r in gemv)


def test_best_per_bucket_by_hand():
    def row(shape, bucket, label, ratio):
        return dict(shape=shape, bucket=bucket, label=label, role="candidate", ratio=ratio)

    rows = [row("a", 16, "x", 0.9), row("b", 16, "x", 1.1), row("a", 16, "y", 0.95), row("b", 16, "y", 0.96),
            row("a", 16, "z", 0.5)]  # z ran on one shape only: not comparable
    score, name, n = tune.best_per_bucket(rows)[16]
    assert name == "y" and n == 2 and score == pytest.approx((0.95 * 0.96) ** 0.5)


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "the following arguments are required: --out"),
    (["--dry-run", "--out", "X", "--sweep", "everything"], "invalid choice: 'everything'"),
    (["--dry-run", "--out", "X", "--shapes", "llama-3-8b"], "unknown shape(s) llama-3-8b"),
    (["--dry-run", "--out", "X", "--tokens", "0"], "--tokens must be positive"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_candidate_that_fails_to_time_loses_only_itself():
    class Timer:
        def many(self, fns):
            if "bad" in fns:
                raise RuntimeError("capture failed")
            return {name: 1e-3 for name in fns}

    rows = [dict(label="good"), dict(label="bad")]
    secs = tune._time_all(Timer(), {"gemm_only": None, "good": None, "bad": None}, rows, torch.zeros(1))
    assert secs == {"gemm_only": 1e-3, "good": 1e-3}
    assert rows[1]["status"] == "error" and "capture failed" in rows[1]["reason"] and "status" not in rows[0]
