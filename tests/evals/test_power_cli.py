"""`python -m swiglu_patch.evals.power` as the GPU runs it, dry on CPU: the model from the carryable
slice, the fixture check, the record; the Triton choices and their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiglu_patch.evals.defects import DEFECTS, KERNEL_LESS, DefectPatcher
from swiglu_patch.evals.power import FIXTURE, main, patchers_for

ROOT = Path(__file__).resolve().parents[2]


def test_patchers_for_the_kernels_leave_out_what_has_no_kernel_form():
    patchers, left_out = patchers_for("triton", "cpu")
    assert left_out == list(KERNEL_LESS) and list(patchers) == ["clean", *(d for d in DEFECTS if d not in KERNEL_LESS)]
    assert {p.backend for p in patchers.values()} == {"triton"}
    assert all(isinstance(p, DefectPatcher) for name, p in patchers.items() if name != "clean")
    assert patchers_for("auto", "cuda")[1] == list(KERNEL_LESS)
    patchers, left_out = patchers_for("auto", "cpu")  # auto on CPU: the PyTorch path carries every defect
    assert left_out == [] and len(patchers) == 1 + len(DEFECTS)


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "triton", "--dtype", "bfloat16"], "interpreter, whose bf16 tl.dot is wrong: use --dtype float32"),
    (["--device", "cuda"], "CUDA is not available here; use --device cpu"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["--slice", "SLICE"], "no slice.json"),
])
def test_bad_command_lines_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    if "cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here")
    args = [str(tmp_path) if a == "SLICE" else a for a in args]
    assert main(["--out", str(tmp_path / "out"), "--fixture", str(ROOT / FIXTURE), *args]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("python -m swiglu_patch.evals.power: error:") and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.real_model
def test_power_from_the_slice(gemma3_slice, tmp_path):
    """The GPU command's path on CPU, small: the slice's model passes the fixture check and every row is measured."""
    out = tmp_path / "out"
    assert main(["--out", str(out), "--fixture", str(ROOT / FIXTURE), "--slice", str(gemma3_slice),
                 "--questions", "2", "--max-tokens", "256", "--commit", "abc1234"]) == 0
    record = json.loads((out / "power.json").read_text())
    assert record["model_check_max_abs_logit_diff"] < 1e-3  # float32 on a CPU: ~3e-5 from transformers' own load
    assert record["environment"]["git"]["commit"] == "abc1234" and record["left_out"] == []
    assert list(record["results"]) == ["clean", *DEFECTS]
    assert record["results"]["clean"]["tokens"]["label"] == "agrees"
    assert record["results"]["swap_gate_up"]["tokens"]["label"] == "DIFFERENCE"
    assert "| gate and up swapped, every layer |" in (out / "power.md").read_text()
