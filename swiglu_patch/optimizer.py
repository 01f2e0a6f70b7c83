"""An optimizer built before `apply_fused_mlp`: refused at its next step, or moved onto the packed weights.

Patching replaces each MLP's trainable gate/up parameters by one packed parameter
(``gate_up_interleaved`` [2*I, K], and its bias). An optimizer built before still holds the old
parameters, which the model no longer uses: its steps would leave gate and up untrained, and
keep their memory alive. So:

- the old parameters are marked when they are packed (`mark_packed`, from the fused module),
  and a global optimizer step pre-hook raises on the step of any optimizer that holds one,
  naming the fix;
- an optimizer that has already stepped (mid-training: every optimizer's step is recorded,
  weakly, from this module's import on) and holds a parameter being packed gets a warning at
  patch time. Nothing else warns: an optimizer built after patching holds no old parameter;
- `repoint_optimizer(optimizer)` is the fix for an optimizer that must live on (mid-training,
  a schedule already attached): in each param group it puts the packed parameter where the
  gate parameter was and drops the up one, and packs their state the same way as the
  weights (row-interleaved, `kernels/layout.py`), so the next step is the one the unpatched
  model would have taken (AdamW's moments, SGD's momentum; scalar state such as ``step``
  must agree between gate and up).

Building the optimizer after patching (as `transformers.Trainer` does) needs neither.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .kernels.layout import interleave_gate_up

# old parameter (by identity, held weakly) -> (weakref to the fused module, packed attribute, half)
_PACKED = WeakIdKeyDictionary()
_hook = None
_STEPPED = weakref.WeakSet()  # optimizers that have taken a step (eager), held weakly


def _record_step(optimizer, args, kwargs):
    if not torch.compiler.is_compiling():  # a compiled step is not traced through this
        _STEPPED.add(optimizer)


register_optimizer_step_pre_hook(_record_step)


def mark_packed(fused: nn.Module, consumed: dict[tuple[str, str], nn.Parameter]) -> None:
    """Record that trainable `consumed` parameters now live packed in `fused`.

    Args:
        fused: the `FusedGatedMLP` holding the packed parameters.
        consumed: {(half, suffix): old parameter}, half "gate", "up" or "gate_up" (chunked),
            suffix "weight" or "bias".

    Warns (UserWarning) when an optimizer that has stepped holds one of them.
    """
    global _hook
    for (half, suffix), param in consumed.items():
        if param.requires_grad:
            _PACKED[param] = (weakref.ref(fused), "gate_up_interleaved" + ("_bias" if suffix == "bias" else ""), half)
    if _PACKED and _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_stale_parameters)
    packed = {id(p) for p in consumed.values() if p.requires_grad}
    holders = [o for o in list(_STEPPED) if any(id(p) in packed for g in o.param_groups for p in g["params"])]
    if holders:
        warnings.warn(
            f"apply_fused_mlp: an optimizer ({type(holders[0]).__name__}) holds gate/up parameters that are now "
            "packed into gate_up_interleaved; the model no longer uses them, and its next step() raises. Move it "
            "onto the packed parameters with swiglu_patch.optimizer.repoint_optimizer(optimizer) (its state moves "
            "too), or build the optimizer after patching",
            stacklevel=3,
        )


def _stale(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    if not _PACKED:
        return []
    return [p for group in optimizer.param_groups for p in group["params"] if p in _PACKED]


def _refuse_stale_parameters(optimizer, args, kwargs):
    stale = _stale(optimizer)
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: the optimizer holds {len(stale)} gate/up parameter(s) that "
            "apply_fused_mlp packed into gate_up_interleaved; the model no longer uses them, so this step would not "
            "train gate and up. Build the optimizer after apply_fused_mlp, or move this one onto the packed "
            "parameters with swiglu_patch.optimizer.repoint_optimizer(optimizer) (its state moves too)"
        )


def _pack_state(name: str, halves: dict[str, dict], shapes: dict[str, torch.Size]) -> dict:
    """One packed state dict from the gate and up ones (or the chunked one)."""
    keys = {k for s in halves.values() for k in s}
    out = {}
    for key in sorted(keys):
        values = {h: s.get(key) for h, s in halves.items()}
        if "gate_up" in values:
            v = values["gate_up"]
            out[key] = interleave_gate_up(*v.chunk(2)) if isinstance(v, torch.Tensor) and v.shape == shapes[
                "gate_up"] else v
            continue
        g, u = values.get("gate"), values.get("up")
        if isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor) and g.shape == shapes["gate"] == u.shape:
            out[key] = interleave_gate_up(g, u)
        elif isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor) and g.dim() == 0 and u.dim() == 0:
            if not torch.equal(g, u):
                raise ValueError(f"repoint_optimizer: {name}: state {key!r} differs between gate ({g.item()}) and up "
                                 f"({u.item()}); they cannot share one packed parameter")
            out[key] = g.clone()
        elif g is None and u is None or (not isinstance(g, torch.Tensor) and g == u):
            out[key] = g
        else:
            raise ValueError(f"repoint_optimizer: {name}: cannot pack state {key!r} ({type(g).__name__} and "
                             f"{type(u).__name__}; only tensors of the parameter's shape and equal scalars are packed)")
    return out


def repoint_optimizer(optimizer: torch.optim.Optimizer) -> int:
    """Move an optimizer built before `apply_fused_mlp` onto the packed parameters, state included.

    In each param group, the packed parameter takes the place of the gate parameter and the up
    parameter is dropped; per-parameter state tensors of the parameter's shape (AdamW's
    ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``) are interleaved like the weights,
    scalar state (``step``) must be equal for gate and up and is kept.

    Args:
        optimizer: a torch optimizer whose param groups hold parameters packed by apply_fused_mlp.

    Returns:
        The number of packed parameters it now holds in place of old ones.

    Raises:
        ValueError: gate and up of one MLP are not both in the optimizer, or sit in different
            param groups, or their state cannot be packed; nothing is changed then.
        RuntimeError: a fused module was deleted since.
    """
    plan = {}  # (id of fused, attr) -> {half: (group index, param)}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p in _PACKED:
                ref, attr, half = _PACKED[p]
                fused = ref()
                if fused is None:
                    raise RuntimeError("repoint_optimizer: the fused module these parameters were packed into is gone")
                plan.setdefault((id(fused), attr), {"fused": fused, "attr": attr})[half] = (gi, p)
    moves = []
    for entry in plan.values():
        fused, attr = entry.pop("fused"), entry.pop("attr")
        name = f"{type(fused).__name__}.{attr}"
        if "gate_up" not in entry and set(entry) != {"gate", "up"}:
            missing = {"gate", "up"} - set(entry)
            raise ValueError(f"repoint_optimizer: {name}: the optimizer holds {', '.join(entry)} but not "
                             f"{', '.join(missing)}; gate and up train as one packed parameter")
        groups = {gi for gi, _ in entry.values()}
        if len(groups) != 1:
            raise ValueError(f"repoint_optimizer: {name}: gate and up are in different param groups {sorted(groups)}; "
                             "one packed parameter can follow one group's hyperparameters only")
        halves = {h: optimizer.state.get(p, {}) for h, (_, p) in entry.items()}
        shapes = {h: p.shape for h, (_, p) in entry.items()}
        state = _pack_state(name, halves, shapes) if any(halves.values()) else {}
        moves.append((groups.pop(), entry, getattr(fused, attr), state))
    for gi, entry, packed, state in moves:
        params = optimizer.param_groups[gi]["params"]
        first = entry.get("gate_up", entry.get("gate"))[1]
        for _, p in entry.values():
            optimizer.state.pop(p, None)
        params[next(i for i, p in enumerate(params) if p is first)] = packed
        optimizer.param_groups[gi]["params"] = [p for p in params if all(p is not q for _, q in entry.values())]
        if state:
            optimizer.state[packed] = state
    return len(moves)
