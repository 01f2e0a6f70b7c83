"""gpt-oss in bf16 on CPU: the fused experts' PyTorch path (backend "torch") against transformers'
default experts path, each measured against the same model in fp32.

The weights are bf16 values, so the fp32 copy computes exactly what the bf16 model rounds: its
distance from the default bf16 model is the default's own bf16 noise floor. Pass rule (quack's,
as in the kernel tests): the patched bf16 model's error against fp32 is within twice that floor,
plus a small epsilon, at two levels:

- each experts module alone, on the hidden states and routing the default bf16 model gave it
  (teacher forced: a routing flip upstream cannot blur it);
- the whole model: every layer's hidden state [B, T, K] and the logits [B, T, vocab].

The tiny model (the zoo's gpt_oss) is given what gpt-oss adds and random init leaves out: random
biases, and gate_up weights scaled so that part of the pre-activations pass the clamp (limit 7).
The Triton kernels cannot be checked in bf16 here (the interpreter's bf16 tl.dot is wrong).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err
from zoo.tiny_zoo import build

from swiglu_patch import apply_fused_mlp

GATE_UP_SCALE = 4.0  # pre-activations of std ~6 at this init: the clamp bites on part of them
EPS = 1e-4


def _bf16_gpt_oss(seed: int) -> torch.nn.Module:
    """The zoo's tiny gpt_oss with random experts biases and scaled gate_up, in bf16, eval mode."""
    model = build("gpt_oss", seed=seed).model
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.mul_(GATE_UP_SCALE)
            experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape, generator=gen))
            experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape, generator=gen))
    return model.to(torch.bfloat16).eval()


def _forward(model, ids) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple]]:
    """Logits, every layer's hidden state, and each experts module's (hidden_states [T, K],
    top_k_index [T, top_k], top_k_weights [T, top_k]) as the model called it."""
    calls: list[tuple] = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, a: calls.append(tuple(t.clone() for t in a[:3])))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits, list(out.hidden_states[1:]), calls


@pytest.fixture(scope="module")
def three():
    """(default bf16, patched bf16, fp32 copy) of one tiny gpt_oss, and a [2, 32] prompt."""
    seed = 0
    default = _bf16_gpt_oss(seed)
    patched = copy.deepcopy(default)
    apply_fused_mlp(patched, backend="torch")
    fp32 = copy.deepcopy(default).float()
    ids = torch.randint(3, default.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    return default, patched, fp32, ids


def test_the_clamp_bites_and_the_floor_is_a_bf16_one(three):
    default, _, fp32, ids = three
    _, _, calls = _forward(fp32, ids)
    passed = 0.0
    for layer, (x, index, _) in zip(fp32.model.layers, calls):
        experts = layer.mlp.experts
        pre = torch.cat([x[(index == e).any(-1)] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
                         for e in index.unique().tolist()])
        gate, up = pre[:, ::2], pre[:, 1::2]  # interleaved pairs
        clamped = torch.cat([gate > experts.limit, up.abs() > experts.limit])
        passed = max(passed, clamped.float().mean().item())
    assert passed > 0.05  # the clamp is exercised, not only the linear part of the gate
    assert default.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    floor = rel_err(_forward(default, ids)[0], _forward(fp32, ids)[0])
    assert 1e-3 < floor < 0.3  # bf16 rounding, not fp32's and not a model gone chaotic


def test_each_patched_experts_module_is_within_twice_the_default_bf16_floor(three):
    default, patched, fp32, ids = three
    _, _, calls = _forward(default, ids)
    for i, (x, index, weights) in enumerate(calls):
        with torch.no_grad():
            ref = fp32.model.layers[i].mlp.experts(x.float(), index, weights.float())
            theirs = default.model.layers[i].mlp.experts(x, index, weights)
            ours = patched.model.layers[i].mlp.experts(x, index, weights)
        assert ours.dtype == torch.bfloat16
        floor, err = rel_err(theirs, ref), rel_err(ours, ref)
        assert err <= 2 * floor + EPS, f"layer {i}: patched {err:.3g} against the default's bf16 floor {floor:.3g}"


def test_the_patched_model_is_within_twice_the_default_bf16_floor(three):
    default, patched, fp32, ids = three
    ref_logits, ref_hidden, _ = _forward(fp32, ids)
    theirs_logits, theirs_hidden, _ = _forward(default, ids)
    ours_logits, ours_hidden, _ = _forward(patched, ids)
    for i, (ours, theirs, ref) in enumerate(zip(ours_hidden, theirs_hidden, ref_hidden)):
        floor, err = rel_err(theirs, ref), rel_err(ours, ref)
        assert err <= 2 * floor + EPS, f"layer {i} hidden state: patched {err:.3g}, default's floor {floor:.3g}"
    floor, err = rel_err(theirs_logits, ref_logits), rel_err(ours_logits, ref_logits)
    assert err <= 2 * floor + EPS, f"logits: patched {err:.3g}, default's floor {floor:.3g}"
