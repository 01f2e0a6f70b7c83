"""benchmarks/bench_moe_train_step.py: the whole script on CPU (--dry-run, full training and LoRA), its
comparison against grouped_mm by hand, --render, and its one-line errors."""

import json

import pytest
import torch

from benchmarks.bench_moe_train_step import compare, main


def test_compare_by_hand():
    results = {"grouped_mm": {"rounds_step_s": [0.10, 0.12], "losses": [2.0, 1.0], "peak_mib": 1000.0},
               "store": {"rounds_step_s": [0.06, 0.07], "losses": [2.05, 1.2], "peak_mib": 650.0},
               "recompute": {"rounds_step_s": [0.07], "losses": [2.0, 1.0], "peak_mib": 800.0}}
    compare(results, lora=True)
    store, recompute = results["store"], results["recompute"]
    assert store["time_over_grouped_mm"] == pytest.approx(0.065 / 0.11)
    assert store["targets"] == {"time_over_grouped_mm <= 0.6": True, "peak_over_grouped_mm <= 0.7": True}
    assert store["losses_within_tolerance"] is False  # 1.2 - 1.0 > 1e-2 + 5e-2 * 1.0
    assert store["max_loss_diff"] == pytest.approx(0.2)
    assert recompute["losses_within_tolerance"] is True
    assert recompute["targets"] == {"time_over_grouped_mm <= 0.6": False, "peak_over_grouped_mm <= 0.7": False}
    assert "targets" not in results["grouped_mm"]


@pytest.mark.parametrize("lora", [0, 4])
def test_dry_run_measures_every_way_on_its_own_path(tmp_path, lora):
    argv = ["--dry-run", "--out", str(tmp_path), "--warmup", "1", "--steps", "2", "--rounds", "2", "--lora", str(lora)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    results = data["results"]
    assert set(results) == {"grouped_mm", "store", "recompute"}
    for way, e in results.items():
        assert len(e["rounds_step_s"]) == 2 and len(e["losses"]) == 3
        path = e["lora_path"]
        assert path["experts_implementation"] == ["grouped_mm" if way == "grouped_mm" else "swiglu_patch"], way
        assert path["experts_calls"] == 2  # 2 layers, one forward
        assert set(path) == {"delta_weight_calls", "delta_factors_calls", "experts_calls",
                             "experts_calls_parametrized", "experts_calls_lora_in_kernels", "experts_implementation"}
        if lora and way == "grouped_mm":  # PEFT's own path: the weight parametrized, nothing bound
            assert path["experts_calls_parametrized"] == 2 and path["experts_calls_lora_in_kernels"] == 0
        assert (e["trainable_params"] < 60_000) == bool(lora), e["trainable_params"]  # adapters only, or all
        if way != "grouped_mm":
            assert e["losses_within_tolerance"] and e["max_loss_diff"] < 1e-5, (way, e["losses"])
            assert ("targets" in e) == bool(lora)
    md = (tmp_path / "results.md").read_text()
    assert "| store |" in md and ("Which LoRA path ran" in md) == bool(lora)
    (tmp_path / "results.md").unlink()
    assert main(["--render", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "results.md").read_text() == md


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    for argv in (["--dry-run"], ["--out", str(tmp_path), "--model", "gpt-oss-20b", "--lora", "8"],
                 ["--render", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path)])
        assert e.value.code == 2 and "--dry-run" in capsys.readouterr().err
