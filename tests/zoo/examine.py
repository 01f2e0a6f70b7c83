"""Every check of the zoo on one tiny model: `examine(model_type, variant)` -> `Row`.

On one build of the model, in fp32 on CPU (fused modules on the PyTorch reference, backend "auto"):

1. before patching: the output of every gated module found (`find_gated`) on fixed random inputs
   at input scales 1 and 30, the logits and 4 greedy tokens of a random prompt, the state dict's bytes;
2. `apply_fused_mlp(strict=True)`: either it patches every gated module, or it raises `PatchError`
   and leaves the model as it was (state dict bytes, no fused module);
3. `apply_fused_mlp(strict=False)`: each patched module's output equals the original's at both scales
   (max |diff| <= 1e-5 of max |original|); logits within 1e-4 of their largest value and the greedy
   tokens equal (where the unpatched model's own tokens change when its patched modules' weights
   change by 1e-6 of themselves, a note says the tokens cannot be compared); the report names every module that `find_gated` found (and only those) and every
   module whose forward looks gated (`_gated_looking`, read from the source); the state dict has the
   same keys and bytes, patched or not; `save_pretrained` reloads in plain transformers with no key
   missing or unexpected and the same logits;
4. `unpatch`: the state dict bit for bit and the logits equal to before.

A check that fails is a `failures` entry; a check that cannot run on the tiny model (its forward
fails before any patching) is a `notes` entry with the reason.
"""

from __future__ import annotations

import copy
import inspect
import re
import tempfile
import time
from dataclasses import dataclass, field

import torch
from zoo.tiny_zoo import VOCAB, Built, CannotBuild, build, quiet

from swiglu_patch import FusedGatedMLP, PatchError, PatchReport, apply_fused_mlp, is_patched, unpatch
from swiglu_patch.patch import find_gated

MODULE_TOL, LOGIT_TOL = 1e-5, 1e-4
CHAOS_PERTURBATION = 1e-6  # relative change of the patched modules' weights that `_generate_is_chaotic` tries
SCALES = (1.0, 30.0)

# An independent look for gated modules, from the source of each class's forward: an activation
# multiplied by something, in a module with two Linear children or more. Each one must be named in
# the report. Not gated MLPs, though they match:
NOT_GATED_MLPS = {"xLSTMLayer"}  # an mLSTM cell's input/forget/output gates
_GATED_SOURCE = re.compile(r"(act\w*|silu|gelu|swish|glu)\s*\(.*\)\s*\*|\*\s*(self\.)?(act\w*|F\.silu|F\.gelu)\s*\(",
                           re.IGNORECASE)

@dataclass
class Row:
    """The zoo's verdict on one (model type, variant)."""

    model_type: str
    variant: str = "default"
    status: str = ""  # "patched", "refused", "no gated MLP", "could not build"
    patched: int = 0
    gated: int = 0
    classes: list[str] = field(default_factory=list)  # patched classes, "LlamaMLP (silu)"
    refusals: list[str] = field(default_factory=list)  # "Class: reason", one per (class, reason)
    strict_raised: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    report: PatchReport | None = field(default=None, repr=False)  # of strict=False (or of strict=True if it passed)


def _bytes(sd: dict) -> dict:
    return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in sd.items()}


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _prompt(built: Built) -> torch.Tensor:
    """Token ids in [3, 128) that are no special token of the config."""
    special = set()

    def walk(d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, int) and not isinstance(v, bool) and isinstance(k, str) and k.endswith(("_id", "_index")):
                special.add(v)

    walk(built.config.to_dict())
    allowed = torch.tensor([i for i in range(3, VOCAB) if i not in special])
    gen = torch.Generator().manual_seed(1)
    return allowed[torch.randint(len(allowed), (2, 7), generator=gen)]


def _logits(model, ids):
    torch.manual_seed(0)  # some forwards draw noise (Diffusion-Gemma's denoising)
    with torch.no_grad():
        out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.double()


def _generate(model, ids):
    torch.manual_seed(0)
    if getattr(model.generation_config, "max_denoising_steps", None):  # Diffusion-Gemma: 48 by default
        model.generation_config.max_denoising_steps = 4
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    return out if isinstance(out, torch.Tensor) else out.sequences


def _generate_is_chaotic(model, ids, tokens, report) -> bool:
    """Whether the unpatched `model`'s `_generate` leaves `tokens` when the weights of the modules the patch
    replaced are scaled by 1 + CHAOS_PERTURBATION (float rounding's size): then no patch other than a bit-identical
    one can give the same tokens (a diffusion decoder's unmasking order on a tiny random model)."""
    perturbed = copy.deepcopy(model)
    names = [*report.patched]
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if any(name.startswith(n + ".") for n in names) and param.is_floating_point():
                param.mul_(1 + CHAOS_PERTURBATION)
    return not torch.equal(_generate(perturbed, ids), tokens)


def _module_inputs(k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, k, generator=gen) * s for s in SCALES]


def _experts_inputs(module, seed: int):
    """[(x [T, K], top_k_index [T, k], top_k_weights [T, k]) at each scale] for an experts module (k = 2, or
    1 where the module has one expert)."""
    gen = torch.Generator().manual_seed(seed)
    e = module.gate_up_proj.shape[0]
    k = module.gate_up_proj.shape[1 if getattr(module, "is_transposed", False) else 2]
    top_k = min(2, e)
    index = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(10)])
    weights = torch.rand(10, top_k, generator=gen)
    return [(torch.randn(10, k, generator=gen) * s, index, weights) for s in SCALES]


def _module_outputs(model) -> dict:
    """{name: [output at each scale]} of every gated MLP whose forward runs on one tensor, and of
    every MoE experts module (on random routing)."""
    outs = {}
    found, _ = find_gated(model)
    for i, g in enumerate(found):
        try:
            with torch.no_grad():
                if g.experts:
                    outs[g.name] = [g.module(*args) for args in _experts_inputs(g.module, i)]
                    continue
                if g.family is None:
                    continue
                k = getattr(g.module, g.family.projections[0]).in_features
                outs[g.name] = [g.module(x) for x in _module_inputs(k, i)]
        except Exception:  # noqa: BLE001 - modules whose forward needs more than one tensor
            continue
    return outs, [g.name for g in found]


def _gated_looking(model, named: set[str]) -> list[str]:
    """Modules outside `named` whose forward multiplies an activation by something (see `_GATED_SOURCE`)."""
    out = []
    for name, module in model.named_modules():
        if any(name == n or name.startswith(n + ".") for n in named) or type(module).__name__ in NOT_GATED_MLPS:
            continue
        if sum(isinstance(c, torch.nn.Linear) for c in module.children()) < 2:
            continue
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            continue
        if _GATED_SOURCE.search(source):
            out.append(f"{name} ({type(module).__name__})")
    return out


def _try(row: Row, what: str, fn):
    """fn(), or None with a note when it fails on the unpatched model."""
    try:
        with quiet():
            return fn()
    except Exception as e:  # noqa: BLE001
        row.notes.append(f"{what} not checked: fails on the unpatched tiny model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120] if str(e) else ''})")
        return None


def examine(model_type: str, variant: str = "default", save: bool = True) -> Row:
    """All checks on one tiny model (see the module docstring)."""
    t0 = time.perf_counter()
    row = Row(model_type, variant)
    try:
        built = build(model_type, variant)
    except CannotBuild as e:
        row.status, row.seconds = "could not build", time.perf_counter() - t0
        row.notes.append(str(e))
        return row
    model = built.model
    ids = _prompt(built)
    before_modules, found_names = _module_outputs(model)
    logits = tokens = None
    if before_modules:  # something may be patched: the model's outputs to compare with
        logits = _try(row, "logits", lambda: _logits(model, ids))
        tokens = _try(row, "greedy tokens", lambda: _generate(model, ids)) if logits is not None else None
    original = _bytes(model.state_dict())

    try:
        with quiet():
            strict_report = apply_fused_mlp(model, strict=True)
    except PatchError:
        row.strict_raised = True
        strict_report = None
        if is_patched(model) or not _same_bytes(_bytes(model.state_dict()), original):
            row.failures.append("strict=True raised but changed the model")
    with quiet():
        report = apply_fused_mlp(model, strict=False)
    if strict_report is not None:
        if report.patched or report.already_patched != strict_report.patched:
            row.failures.append("a second apply_fused_mlp changed something")
        report = strict_report
    elif report.not_patched == [] and found_names:
        row.failures.append("strict=True raised but strict=False left nothing unpatched")

    row.report = report
    row.patched, row.gated = len(report.patched), len(found_names)
    row.classes = sorted({f"{type(m._original).__name__} ({m.epilogue.describe()})" for m in model.modules()
                          if isinstance(m, FusedGatedMLP)})
    row.refusals = sorted({f"{n.module_class}: {n.reason}" for n in report.not_patched})
    named = set(report.patched) | {n.name for n in report.not_patched}
    if named != set(found_names):
        row.failures.append(f"the report names {sorted(named ^ set(found_names))} differently from find_gated")
    unnamed = _gated_looking(model, named)
    if unnamed:
        row.failures.append(f"modules that look gated are not in the report: {unnamed[:4]}")
    row.status = ("no gated MLP" if not found_names else "patched" if report.patched and not report.not_patched
                  else "refused" if not report.patched else "patched, some refused")
    if found_names and not report.has_gated_mlp:
        row.failures.append("the report says no gated MLP")

    for name in report.experts:  # the same module, now on the fused experts kernels
        module = model.get_submodule(name)
        for args, ref in zip(_experts_inputs(module, found_names.index(name)), before_modules.get(name, [])):
            with torch.no_grad():
                out = module(*args)
            err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if not err <= MODULE_TOL:
                row.failures.append(f"{name}: the fused experts differ from the original by {err:.3g}")
    for name in report.patched:
        if name in report.experts:
            continue
        if name not in before_modules:
            row.failures.append(f"{name} was patched but its forward did not run on one tensor before")
            continue
        fused = model.get_submodule(name)
        for scale, x, ref in zip(SCALES, _module_inputs(fused.gate_up_interleaved.shape[1], found_names.index(name)),
                                 before_modules[name]):
            with torch.no_grad():
                out = fused(x)
            err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if not err <= MODULE_TOL:
                row.failures.append(f"{name}: fused output off by {err:.2g} at input scale {scale:g}")

    if not _same_bytes(_bytes(model.state_dict()), original):  # nothing dropped, renamed or changed
        row.failures.append("the patched model's state dict differs from the original (keys or bytes)")
    if report.patched:
        _check_patched_model(row, built, ids, logits, tokens, original, save)
    row.seconds = time.perf_counter() - t0
    return row


def _check_patched_model(row, built, ids, logits, tokens, original, save):
    model = built.model
    try:
        with quiet():
            after = _logits(model, ids) if logits is not None else None
            gen = _generate(model, ids) if tokens is not None else None
    except Exception as e:  # noqa: BLE001 - the patch made the model crash
        row.failures.append(f"the patched model crashes: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        after = gen = None
    if after is not None:
        scale = logits.abs().max().item()
        diff = (after - logits).abs().max().item()
        if not diff <= LOGIT_TOL * scale:
            row.failures.append(f"logits differ by {diff:.3g} (largest logit {scale:.3g})")
    tokens_differ = gen is not None and not torch.equal(gen, tokens)
    problems = _save_reload_problems(built, ids, logits) if save else []
    unpatch(model)
    if tokens_differ:
        if _generate_is_chaotic(model, ids, tokens, row.report):
            row.notes.append("greedy tokens differ, as the unpatched model's own do when its patched modules' "
                             f"weights change by {CHAOS_PERTURBATION:g} of themselves: not compared")
        else:
            row.failures.append("greedy tokens differ")
    if is_patched(model) or not _same_bytes(_bytes(model.state_dict()), original):
        row.failures.append("unpatch did not restore the state dict bit for bit")
    if logits is not None and not torch.equal(_logits(model, ids), logits):
        row.failures.append("logits after unpatch differ from before")
    if problems:
        baseline = _save_reload_problems(built, ids, logits)  # the unpatched model, through the same round trip
        if baseline and [_kind(p) for p in baseline] == [_kind(p) for p in problems]:
            row.notes.append(f"save/reload: the unpatched model does not round-trip either ({baseline[0][:150]})")
        else:
            row.failures.extend(problems)


def _kind(problem: str) -> str:
    """A problem without its measured number (two runs of a nondeterministic model differ there)."""
    return problem.split(" differ by ")[0]


def _save_reload_problems(built, ids, logits) -> list[str]:
    """What goes wrong when `built.model` is saved and reloaded with plain transformers."""
    with tempfile.TemporaryDirectory() as tmp, quiet():
        try:
            built.model.save_pretrained(tmp)
            plain, info = built.auto_class.from_pretrained(tmp, output_loading_info=True, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            return [f"save_pretrained/reload fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"]
    plain.eval()
    problems = []
    if is_patched(plain):
        problems.append("the reloaded model is patched")
    missing, unexpected = sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", []))
    if missing or unexpected:
        problems.append(f"reload: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if logits is not None:
        with quiet():
            reloaded = _logits(plain, ids)
        if not torch.equal(reloaded, logits):
            problems.append(f"reloaded logits differ by {(reloaded - logits).abs().max().item():.3g}")
    return problems
