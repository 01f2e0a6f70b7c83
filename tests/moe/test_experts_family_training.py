"""Every fusable MoE family trains one step as eager, through the reference and through the kernels.

For each MoE type of the installed transformers whose experts `apply_fused_mlp` fuses (`moe.families`),
built tiny in fp32 (`zoo.tiny_zoo.build`), in train mode: the eager model and a patched deepcopy (same
weights) each take one forward on a fixed prompt as its own labels (plus 0.01 x the router's
auxiliary loss where the model returns one), a backward and one SGD step (lr 0.5). The losses must
agree to 1e-6 relative; then the patched model is unpatched and every parameter (experts' 3-D weights,
router, attention, embeddings, everything) must equal the eager model's after its step to 1e-5:
max |patched - eager| <= 1e-5 * max |eager|, per tensor. The step must move the experts' weights by
at least 1e-3 of their scale, so the comparison sees it.

Through backend="torch" (`experts_reference`, differentiable) for every family. Through
backend="triton" (the interpreter on CPU, the compiled kernels on CUDA) for one family per distinct
signature, the first by name (`moe.families.representatives`); the others skip, naming it. About 3
minutes on 2 cores with the grouping: slow. Every forward is seeded the same, so dropout and router
noise draw alike in both models.
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import pytest
import torch
from moe.families import MOE_TYPES, family, kernel_key, representatives, skip_unless_representative, spec_of_key
from zoo.examine import _prompt
from zoo.tiny_zoo import build, quiet

from swiglu_patch import apply_fused_mlp, unpatch
from swiglu_patch.experts import ExpertsSpec
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, ExpertsLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # conftest turns the interpreter on where CUDA is absent
LR, LOSS_TOL, PARAM_TOL, MIN_MOVE = 0.5, 1e-6, 1e-5, 1e-3
ROUNDING, NOISE_FACTOR = 1e-7, 10.0  # `_rounding_sensitivity`'s change, and how far past it a parameter may land

pytestmark = pytest.mark.slow


def _objective(model, ids):
    """(loss, loss + 0.01 * router aux loss or loss alone), fp32 scalars: one seeded forward of ids [B, L] as labels."""
    torch.manual_seed(0)
    try:
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
    except TypeError:  # a model whose forward takes no output_router_logits
        torch.manual_seed(0)
        out = model(input_ids=ids, labels=ids)
    aux = getattr(out, "aux_loss", None)
    return out.loss, out.loss if aux is None else out.loss + 0.01 * aux


def _step(model, ids):
    """One SGD step on `_objective`; its (loss, objective) as floats."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss, objective = _objective(model, ids)
    objective.backward()
    opt.step()
    return loss.item(), objective.item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 where both are 0)."""
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _rounding_sensitivity(model_type: str, ids, stepped: dict) -> dict:
    """{parameter name: max-abs / scale} between eager's `stepped` parameters and those of eager's own step from
    the same build with its 3-D experts weights scaled by 1 + ROUNDING (a change of float rounding's size): how
    far rounding alone moves each parameter's step (some families amplify it past PARAM_TOL: GLM-5-Next's
    hyper-connection bases, 6e-6 from 1e-7)."""
    perturbed = build(model_type).model.to(DEVICE).train()
    with torch.no_grad():
        for p in perturbed.parameters():
            if p.dim() == 3:
                p.mul_(1 + ROUNDING)
    _step(perturbed, ids)
    return {n: _rel(p.detach(), stepped[n].detach()) for n, p in perturbed.named_parameters()}


def _trains_as_eager(model_type: str, backend: str):
    built = build(model_type)
    eager = built.model.to(DEVICE).train()
    ids = _prompt(built).to(DEVICE)
    patched = copy.deepcopy(eager)
    before = {n: p.detach().clone() for n, p in eager.named_parameters() if p.dim() == 3}
    try:
        want = _step(eager, ids)
    except Exception as e:  # noqa: BLE001 - the unpatched tiny model's own failure
        pytest.skip(f"the unpatched tiny model cannot train: {type(e).__name__}: {str(e)[:120]}")
    with quiet():
        report = apply_fused_mlp(patched, strict=False, backend=backend)
    assert sorted({kernel_key(s) for s in report.experts.values()}) == list(family(model_type).signature)
    got = _step(patched, ids)
    assert abs(got[0] - want[0]) <= LOSS_TOL * abs(want[0]), f"loss {got[0]!r} vs eager {want[0]!r}"
    assert abs(got[1] - want[1]) <= LOSS_TOL * abs(want[1]), f"loss + aux {got[1]!r} vs eager {want[1]!r}"
    unpatch(patched)
    mine, theirs = dict(patched.named_parameters()), dict(eager.named_parameters())
    assert mine.keys() == theirs.keys()
    errors = {n: _rel(mine[n].detach(), theirs[n].detach()) for n in theirs}
    bad = {n: e for n, e in errors.items() if not e <= PARAM_TOL}
    if bad:  # parameters whose step eager's own float rounding moves by more than PARAM_TOL
        noise = _rounding_sensitivity(model_type, ids, theirs)
        bad = {n: f"{e:.3g} (eager's own {noise[n]:.3g})" for n, e in bad.items() if not e <= NOISE_FACTOR * noise[n]}
    assert not bad, (f"parameters off eager's after one step (max-abs / scale, tolerance {PARAM_TOL:g}, or "
                     f"{NOISE_FACTOR:g}x what eager's own step moves when its experts' weights change by "
                     f"{ROUNDING:g} of themselves): {bad}")
    moved = max(_rel(theirs[n].detach(), before[n]) for n in before)
    assert moved >= MIN_MOVE, f"the step moved the 3-D weights by only {moved:.3g} of their scale"


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_one_step_on_the_reference_as_eager(model_type):
    f = family(model_type)
    if not f.signature:
        pytest.skip(f.reason)
    _trains_as_eager(model_type, "torch")


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_one_step_on_the_kernels_as_eager(model_type):
    skip_unless_representative(model_type)
    _trains_as_eager(model_type, "triton")


def test_the_signature_is_all_the_kernels_read():
    """Families with one signature patch to equal `ExpertsSpec`s: the key rebuilds each spec exactly, and a
    spec that differs in any one field (the fields listed here are all the spec has) has another key."""
    groups = representatives()
    assert groups, "no MoE family of the installed transformers has fused experts"
    for sig, members in groups.items():
        specs = {spec_of_key(k) for k in sig}
        assert {kernel_key(s) for s in specs} == set(sig)
        assert all(family(t).signature == sig for t in members)
    assert [f.name for f in fields(ExpertsSpec)] == ["epilogue", "layout", "has_bias"]
    assert [f.name for f in fields(ExpertsEpilogue)] == ["gated", "alpha"]
    assert [f.name for f in fields(ExpertsLayout)] == ["transposed", "concatenated"]
    assert [f.name for f in fields(GatedEpilogue)] == ["activation", "gate_scale", "out_scale", "limit", "clamp"]
    base = ExpertsSpec(ExpertsEpilogue(GatedEpilogue("silu", limit=1.0)), ExpertsLayout(), False)
    gated = [replace(base.epilogue.gated, **{name: value}) for name, value in (
        ("activation", "gelu"), ("gate_scale", 0.5), ("out_scale", 2.0), ("limit", 2.0), ("limit", None),
        ("clamp", "activation"))]
    specs = [base, replace(base, has_bias=True), replace(base, layout=ExpertsLayout(transposed=True)),
             replace(base, layout=ExpertsLayout(concatenated=False)),
             replace(base, epilogue=ExpertsEpilogue(base.epilogue.gated, alpha=1.702)),
             *(replace(base, epilogue=ExpertsEpilogue(g)) for g in gated)]
    assert all(spec_of_key(kernel_key(s)) == s for s in specs)
    assert len({kernel_key(s) for s in specs}) == len(specs)


def test_the_kernel_families_cover_the_known_signatures():
    """The families the kernels were written for are fused, and plain SwiGLU and gpt-oss's gate group apart."""
    fused = {t for members in representatives().values() for t in members}
    assert {"qwen3_moe", "gpt_oss", "mixtral", "olmoe"} <= fused
    assert family("qwen3_moe").signature == family("mixtral").signature != family("gpt_oss").signature
