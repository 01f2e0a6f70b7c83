"""benchmarks/bench_moe_lora.py: the whole script on CPU (--dry-run), which path each way ran, and its one-line errors."""

import json

import pytest

from benchmarks.bench_moe_lora import GRADS, main


@pytest.mark.slow
def test_dry_run_measures_every_way_and_names_the_path(tmp_path):
    from swiglu_patch.kernels.device import interpreting

    if not interpreting():
        with pytest.raises(SystemExit) as e:
            main(["--dry-run", "--out", str(tmp_path)])
        assert e.value.code == 2
        return
    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["kind"] == "moe_lora" and len(results["rows"]) == 2
    for row in results["rows"]:
        ways = row["ways"]
        assert set(ways) == {"ours_fused", "peft_grouped_mm", "peft_on_ours"}
        assert ways["ours_fused"]["deltas_built"] == 0  # the adapters ran inside the GEMMs
        assert ways["peft_grouped_mm"]["deltas_built"] == ways["peft_on_ours"]["deltas_built"] == 2
        for way, v in ways.items():
            assert set(v["errors"]) == set(GRADS), way
            assert v["max_error"] < 1e-5, (way, v["errors"])  # fp32 against float64
    assert "| ours_fused | 0 |" in (tmp_path / "results.md").read_text()


def test_no_gpu_and_no_dry_run_is_one_line_and_exit_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dry-run" in err
