"""The planted defects on a tiny model: each changes the fused output the way it says, and
`restore` gives back the model bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from swiglu_patch import is_patched
from swiglu_patch.evals.defects import DEFECTS, DefectPatcher, round_mantissa


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_defect_changes_the_output_and_restores_bit_for_bit(defect):
    model = tiny_model("gemma3_text")  # gelu_tanh: every defect applies
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager = _logits(model, ids)
    patcher = DefectPatcher(defect)
    assert "planted" in patcher.apply(model)
    broken = _logits(model, ids)
    patcher.restore(model)
    assert not is_patched(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (broken - eager).abs().max() > 1e-6, defect  # fp32: the clean patch is off by ~1e-7


def test_other_gelu_needs_a_gelu_model():
    model = tiny_model("llama")  # silu
    with pytest.raises(ValueError, match="needs a GELU model"):
        DefectPatcher("other_gelu").apply(model)
    assert not is_patched(model)
    with pytest.raises(ValueError, match="unknown defect 'nope'"):
        DefectPatcher("nope")


def test_round_mantissa():
    x = torch.tensor([1.0, 1.0 + 2**-4, 1.0 + 3 * 2**-5, -3.3, 0.0])
    assert round_mantissa(x, 3).tolist() == [1.0, 1.0, 1.125, -3.25, 0.0]  # ties to even; -3.3 = -1.65 * 2
    assert torch.equal(round_mantissa(x, 23), x)


def test_power_command_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from swiglu_patch.evals.power import main

    assert main(["--out", str(tmp_path / "out"), "--fixture", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("python -m swiglu_patch.evals.power: error:") and "missing.json" in err[0]
    assert not (tmp_path / "out").exists()
