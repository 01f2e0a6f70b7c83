"""benchmarks/harness/decode_graph.py: the static-cache decode loop gives `generate`'s greedy tokens,
uncaptured on CPU and captured in a CUDA graph on the GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.decode_graph import GraphDecoder
from benchmarks.harness.models import TINY, build_model
from swiglu_patch import apply_fused_mlp

CUDA = torch.cuda.is_available()


def _tiny(device: str, patched: bool, name: str = "llama-3-8b"):
    model = build_model(TINY[name], 2, torch.device(device), torch.float32, seed=0)
    if patched:
        apply_fused_mlp(model, backend="torch" if device == "cpu" else "auto")
    return model


def _generate(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("patched", [False, True])
def test_uncaptured_decode_is_generate_greedy(patched, name):
    """The loop's prompt pass, RoPE positions, 4D mask and cache writes are right: the same tokens
    as `generate` (fp32, so no near-tie decides), twice in a row (run() resets the cache)."""
    model = _tiny("cpu", patched, name)
    ids = torch.randint(2, TINY[name].vocab, (3, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = _generate(model, ids, 9)
        decoder = GraphDecoder(model, ids, 9, capture=False)
        first, seconds = decoder.run()
        first = first.clone()
        again, _ = decoder.run()
    assert want.shape == (3, 9) and seconds > 0
    assert torch.equal(first, want) and torch.equal(again, want)


def test_one_new_token_is_the_prompt_pass_alone():
    model = _tiny("cpu", False)
    ids = torch.randint(2, TINY["llama-3-8b"].vocab, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        tokens, _ = GraphDecoder(model, ids, 1, capture=False).run()
        assert torch.equal(tokens, _generate(model, ids, 1))
    with pytest.raises(ValueError, match="new must be >= 1"):
        GraphDecoder(model, ids, 0, capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("patched", [False, True])
def test_captured_decode_is_generate_greedy(patched):
    """Captured once, replayed per token: the tokens of `generate` (and of two runs in a row)."""
    model = _tiny("cuda", patched)
    ids = torch.randint(2, TINY["llama-3-8b"].vocab, (2, 6), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.inference_mode():
        want = _generate(model, ids, 8)
        decoder = GraphDecoder(model, ids, 8, capture=True)
        assert decoder.graph is not None
        first = decoder.run()[0].clone()
        again = decoder.run()[0]
    assert torch.equal(first, want) and torch.equal(again, want)
