"""Planted defects on the real Gemma 3 270M: each verdict must flag exactly the defects it can see.

The model is google/gemma-3-270m from the real-model extra's GGUF, all 18 layers, cut to the
~2,500 token ids of tests/evals/fixtures/gemma3_planted.json (`swiglu_patch.evals.gguf_slice`;
the session's `gemma3_subvocab_model` of tests/evals/conftest.py, copied here), in bf16 with
the fused PyTorch path, and a float32 reference run: the data sizes are the
issue's, 50 MMLU questions (0-shot, answer letter) and 1,024 tokens of text. The defects
(`swiglu_patch.evals.defects`) are planted in the fused modules after the patch-time probe
passed, as a kernel bug on the GPU would be. `EXPECTED` below is what each verdict must say;
a verdict that goes blind to a defect it saw, or starts flagging the clean patch, fails here.
`python -m swiglu_patch.evals.power` prints the same table (docs/accuracy.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from swiglu_patch.evals.defects import DEFECTS, DefectPatcher
from swiglu_patch.evals.patching import Patcher
from swiglu_patch.evals.power import measure, remap, text_windows

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

# defect -> (per-question verdict flags it, token verdict flags it), at 50 questions and 1,024 tokens.
# Not flagged: a 1% gate error in one layer of 18, and the erf GELU for the tanh one (they move
# the logits less than bf16 rounding does: mean KL ratio ~1.0).
EXPECTED = {
    "clean": (False, False),
    "swap_gate_up": (True, True),
    "zero_16": (True, True),
    "zero_1": (False, True),
    "gate_1pct_all": (False, True),
    "gate_1pct_one": (False, False),
    "other_gelu": (False, False),
    "preact_e4m3": (True, True),
}


@pytest.fixture(scope="module")
def planted(planted_data, gemma3_subvocab_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same rounding on any core count, and no spin-waits on a busy host
    try:
        return _measure(planted_data, copy.deepcopy(gemma3_subvocab_model))  # cast to bf16 there: a copy
    finally:
        torch.set_num_threads(threads)


def _measure(data, model):
    check = data["check"]
    ids = torch.tensor([remap([data["bos_id"]] + data["text_ids"][: check["tokens"]], data["vocab"])])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    model = model.to(torch.bfloat16)
    prompts = [torch.tensor(remap(q["prompt_ids"], data["vocab"])) for q in data["questions"]]
    patchers = {"clean": Patcher(backend="torch"), **{d: DefectPatcher(d) for d in DEFECTS}}
    results = measure(model, prompts, remap(data["choice_ids"], data["vocab"]), [q["answer"] for q in data["questions"]],
                      text_windows(data, 256, 1024), patchers, reference_dtype=torch.float32)
    return logits, torch.tensor(check["next_token_logits"]), results


def test_the_sub_vocabulary_model_is_the_real_model(planted):
    """Its logits are those of transformers' own GGUF load of the full model (float32, 64 tokens)."""
    logits, expected, _ = planted
    assert torch.allclose(logits, expected, atol=1e-3), (logits - expected).abs().max()


def test_every_defect_is_in_the_table():
    assert set(EXPECTED) == {"clean", *DEFECTS}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_verdict_flags_exactly_what_it_can_see(planted, name):
    _, _, results = planted
    r = results[name]
    seen = (r["questions"]["label"] == "DIFFERENCE", r["tokens"]["label"] == "DIFFERENCE")
    detail = (f"{name}: questions {r['questions']['flagged']} ({r['changed']}/{r['n']} answers changed), "
              f"tokens {r['tokens']['flagged']} ratios {r['tokens']['ratios']}")
    assert seen == EXPECTED[name], detail


def test_the_clean_patch_stays_within_the_noise_floor(planted):
    """The clean fused path departs from the float32 answers no more often than eager does, and
    its mean KL from the reference is within 25% of eager's."""
    _, _, results = planted
    r = results["clean"]
    answers = next(c for c in r["questions"]["checks"] if c["check"] == "answers")
    assert answers["fused_departs"] <= answers["eager_departs"] + 2
    assert r["tokens"]["ratios"]["mean"] < 1.25
