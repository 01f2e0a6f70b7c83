"""`FusedGatedMLP`: the module that replaces a gated MLP once it is patched.

It holds the packed ``gate_up_interleaved`` weight [2*I, K] (and bias [2*I] when the MLP
had biases), the MLP's own down projection under its original name (``down_proj``, LFM2's
``w2``), and the original MLP module with its gate and up weights moved to the meta device
(no memory), kept to be put back by `unpatch`.

Its state dict speaks the original checkpoint's language: `state_dict()` writes
``gate_proj.weight`` / ``up_proj.weight`` (or Phi-3's chunked ``gate_up_proj.weight``)
unpacked, and `load_state_dict` reads those keys and packs them, so `save_pretrained`
gives a plain transformers checkpoint and an original checkpoint loads into a patched model.

Under the names of the projections it packed (``gate_proj``, ``up_proj``, or Phi-3's
``gate_up_proj``) it holds `PackedProjection` markers: modules with no weights of their own
that tools finding modules by name reach (PEFT's ``target_modules``). A LoRA layer may wrap a
marker (`swiglu_patch.lora`); the packed halves are then saved under the marker's path
(``gate_proj.base_layer.weight``, as plain PEFT saves them), and the forward adds the
adapters' low-rank update inside the gated GEMM (`swiglu_patch.low_rank`).

A forward takes one of the named `ROUTES` (first match wins), chosen from what the call is:
whether autograd is on, what the down projection is (a plain nn.Linear, PEFT's LoRA over one,
or any other module), whether an input requires grad, whether LoRA rides on gate/up. The
module's repr shows the route of a call with and without autograd.

`FusedGatedMLP.from_original` builds the module and does what patching does to the original:
frees its gate/up weights and marks them for the optimizer check (`swiglu_patch.optimizer`);
``__init__`` only reads the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from .functional import gated_linear_interleaved
from .kernels.epilogue import GatedEpilogue
from .kernels.layout import deinterleave_gate_up, gate_up_rows, interleave_gate_up
from .low_rank import (down_adapters, down_update, gated_linear_low_rank, inference_low_rank_operands,
                       low_rank_operands)
from .optimizer import mark_packed
from .training import gated_mlp_interleaved
from .registry import MLPFamily

# (name, when: (grad enabled, down kind, an input requires grad, LoRA on gate/up) -> bool, what runs)
ROUTES = (
    ("training_op_lora_down", lambda grad, down, trains, low_rank: grad and down == "lora",
     "the whole MLP as one differentiable op (`training.gated_mlp_interleaved`) returning h too; the down "
     "adapters' update computed from h as PEFT's forward does"),
    ("training_op", lambda grad, down, trains, low_rank: grad and down == "plain" and trains,
     "the whole MLP as one differentiable op (`training.gated_mlp_interleaved`), LoRA on gate/up inside it"),
    ("low_rank_inference", lambda grad, down, trains, low_rank: low_rank,
     "the gated GEMM with LoRA's low-rank segment (`low_rank.gated_linear_low_rank`), then the down projection"),
    ("inference", lambda grad, down, trains, low_rank: True,
     "the gated GEMM (`functional.gated_linear_interleaved`), then the down projection"),
)
DOWN_KINDS = ("plain", "lora", "module")


def route(grad: bool, down: str, trains: bool, low_rank: bool) -> str:
    """The name of the first of `ROUTES` whose condition holds.

    Args:
        grad: torch.is_grad_enabled().
        down: "plain" (an nn.Linear run as itself), "lora" (PEFT's LoRA Linear over a plain one)
            or "module" (anything else, or a global forward hook is set).
        trains: x, the packed weight or bias, or the down weight or bias requires grad.
        low_rank: LoRA layers wrap the packed projections.
    """
    return next(name for name, when, _ in ROUTES if when(grad, down, trains, low_rank))


# every combination's route, read on the hot path with one lookup
_ROUTE_OF = {(g, d, t, lr): route(g, d, t, lr) for g in (False, True) for d in DOWN_KINDS for t in (False, True)
             for lr in (False, True)}


class FusedGatedMLP(nn.Module):
    """down(epilogue(x @ Wg^T + bg, x @ Wu^T + bu)) with gate and up packed into one weight.

    The plain epilogue is act(gate) * up; a `GatedEpilogue` adds scales and a clamp. Forward:
    x [..., K] in the weights' dtype -> [..., K'] (down's output width, K for an MLP).

    Args:
        original: the HF MLP module being replaced; its gate/up weights are consumed.
        family: where `original` keeps its pieces.
        epilogue: the gated epilogue (a `GatedEpilogue`, or an activation name: "silu",
            "gelu_tanh", "gelu").
        backend: `gated_linear`'s backend.

    Attributes:
        mode: what training saves for the backward: "store" (the interleaved pre-activation,
            default) or "recompute" (only the input; the gated GEMM runs again in backward).
    """

    def __init__(self, original: nn.Module, family: MLPFamily, epilogue: GatedEpilogue | str, backend: str = "auto"):
        super().__init__()
        gate_w, up_w, gate_b, up_b = _split_original(original, family)
        requires_grad = gate_w.requires_grad
        with torch.no_grad():
            packed = interleave_gate_up(gate_w, up_w)
            packed_bias = interleave_gate_up(gate_b, up_b) if gate_b is not None else None
        self.gate_up_interleaved = nn.Parameter(packed, requires_grad=requires_grad)
        self.gate_up_interleaved_bias = (
            nn.Parameter(packed_bias, requires_grad=requires_grad) if packed_bias is not None else None
        )
        for name, half in _packed_halves(family):  # before down: the original's module order
            self.add_module(name, PackedProjection(self, half))
        self._packed_names = tuple(name for name, _ in _packed_halves(family))
        self.add_module(family.down, getattr(original, family.down))  # the checkpoint's name (LFM2: w2)
        self.epilogue = GatedEpilogue.of(epilogue)
        self.backend = backend
        self.mode = "store"  # training: save the interleaved pre-activation; "recompute" saves only x
        self.family = family
        object.__setattr__(self, "_original", original)  # not a submodule: not in params or state dict

    @classmethod
    def from_original(cls, original: nn.Module, family: MLPFamily, epilogue: GatedEpilogue | str,
                      backend: str = "auto") -> "FusedGatedMLP":
        """The fused module for `original`, as patching makes it: the original's gate/up parameters
        are swapped for meta tensors (their memory freed; `restore` unpacks them back) and marked,
        so that an optimizer still holding them is refused at its step (`optimizer.mark_packed`).
        Arguments as the constructor's."""
        fused = cls(original, family, epilogue, backend)
        mark_packed(fused, _release_gate_up(original, family))
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules, params = self._modules, self._parameters  # direct reads: nn.Module.__getattr__ costs host time
        weight, bias = params["gate_up_interleaved"], params.get("gate_up_interleaved_bias")
        down = modules[self.family.down]
        x_lr = b_lr = None
        wrapped = [m for name in self._packed_names if type(m := modules[name]) is not PackedProjection]
        grad = torch.is_grad_enabled()
        if wrapped:  # LoRA layers over the packed projections: their update rides in the same GEMM
            x_lr, b_lr = low_rank_operands(wrapped, x) if grad else inference_low_rank_operands(self, wrapped, x)
        kind, base, names = _down_kind(down)
        trains = grad and kind == "plain" and any(
            t is not None and t.requires_grad for t in (x, weight, bias, base.weight, base.bias, x_lr, b_lr))
        name = _ROUTE_OF[grad, kind, trains, x_lr is not None]
        if name == "training_op" or name == "training_op_lora_down":
            tensors = (x, weight, bias, base.weight, base.bias, x_lr, b_lr)
            if torch.is_autocast_enabled(x.device.type):  # the op is opaque to autocast: cast as it casts linear
                dtype = torch.get_autocast_dtype(x.device.type)
                tensors = tuple(None if t is None else t.to(dtype) for t in tensors)
            *tensors, x_lr, b_lr = tensors
            if name == "training_op":
                return gated_mlp_interleaved(*tensors, self.epilogue, self.mode, self.backend, x_lr, b_lr)
            y, h = gated_mlp_interleaved(*tensors, self.epilogue, self.mode, self.backend, x_lr, b_lr, return_h=True)
            return down_update(down, names, h, y)
        if name == "low_rank_inference":
            h = gated_linear_low_rank(x, weight, bias, x_lr, b_lr, self.epilogue, self.backend)
        else:
            h = gated_linear_interleaved(x, weight, bias, self.epilogue, self.backend)
        if kind == "module":
            return down(h)
        base_params = base._parameters  # nn.Linear.forward, without __call__
        y = F.linear(h, base_params["weight"], base_params["bias"])
        return y if kind == "plain" else down_update(down, names, h, y)

    def routes(self) -> tuple[str, str]:
        """(the route of a call with autograd on, without), for x that requires no grad."""
        kind, base, _ = _down_kind(self.down)
        low_rank = any(type(self._modules[n]) is not PackedProjection for n in self._packed_names)
        params = (self.gate_up_interleaved, self.gate_up_interleaved_bias) + (
            (base.weight, base.bias) if base is not None else ())
        trains = kind == "plain" and any(p is not None and p.requires_grad for p in params)
        return _ROUTE_OF[True, kind, trains, low_rank], _ROUTE_OF[False, kind, False, low_rank]

    @property
    def down(self) -> nn.Module:
        """The original down projection (registered under its own name, `family.down`)."""
        return self._modules[self.family.down]

    def extra_repr(self) -> str:
        n, k = self.gate_up_interleaved.shape
        with_grad, without = self.routes()
        return (
            f"hidden_size={k}, intermediate_size={n // 2}, epilogue={self.epilogue.describe()!r}, "
            f"bias={self.gate_up_interleaved_bias is not None}, backend={self.backend!r}, "
            f"route={with_grad!r} (autograd on) / {without!r} (off), original={type(self._original).__name__}"
        )

    # -- the original checkpoint's keys --------------------------------------------------

    def _projection_paths(self) -> dict[str, str]:
        """{half: module path} of the packed projections: their marker's path under this module
        (``gate_proj``, or ``gate_proj.base_layer`` when a LoRA layer wraps the marker)."""
        paths = {half: name for name, half in _packed_halves(self.family)}
        for path, m in self.named_modules():
            if isinstance(m, PackedProjection) and m.fused is self:
                paths[m.half] = path
        return paths

    def _checkpoint_tensors(self, keep_vars: bool) -> dict[str, torch.Tensor]:
        """{local key: tensor} in the original module's layout."""
        paths = self._projection_paths()
        out = {}
        for suffix, packed in (("weight", self.gate_up_interleaved), ("bias", self.gate_up_interleaved_bias)):
            if packed is None:
                continue
            gate, up = deinterleave_gate_up(packed if keep_vars else packed.detach())
            if _is_dtensor(packed):  # FSDP2: gate and up keep the packed weight's sharding (balanced checkpoints)
                gate, up = (t.redistribute(packed.device_mesh, packed.placements) for t in (gate, up))
            if self.family.gate_up_chunked:
                out[f"{paths['gate_up']}.{suffix}"] = torch.cat([gate, up])
            else:
                out[f"{paths['gate']}.{suffix}"], out[f"{paths['up']}.{suffix}"] = gate, up
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, tensor in self._checkpoint_tensors(keep_vars).items():
            destination[prefix + key] = tensor

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for hook in self._load_state_dict_pre_hooks.values():  # as nn.Module's own does (tensor_parallel's uses it)
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        paths = self._projection_paths()
        names = [paths[half] for _, half in _packed_halves(self.family)]
        for suffix, param in (("weight", self.gate_up_interleaved), ("bias", self.gate_up_interleaved_bias)):
            if param is None:
                continue
            keys = [f"{prefix}{name}.{suffix}" for name in names]
            missing = [k for k in keys if k not in state_dict]
            if missing:
                missing_keys.extend(missing)
                continue
            tensors = [t.full_tensor() if _is_dtensor(t) else t for t in (state_dict[k] for k in keys)]
            gate, up = tensors if len(tensors) == 2 else tensors[0].chunk(2)
            if 2 * gate.shape[0] != param.shape[0] or gate.shape[1:] != param.shape[1:] or gate.shape != up.shape:
                error_msgs.append(
                    f"size mismatch for {keys}: checkpoint has {[tuple(t.shape) for t in tensors]}, the fused "
                    f"module packs them into {tuple(param.shape)}"
                )
                continue
            with torch.no_grad():
                _copy_packed(param, interleave_gate_up(gate.to(param.device, param.dtype),
                                                       up.to(param.device, param.dtype)))
        if strict:  # the packed names too: DCP's full-state loading adds the parameters' own (current) values
            known = set(self._modules) | {"gate_up_interleaved", "gate_up_interleaved_bias"}
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :].split(".", 1)[0] not in known:
                    unexpected_keys.append(key)

    # -- back to the original ------------------------------------------------------------

    def restore(self) -> nn.Module:
        """The original MLP module, with gate/up weights unpacked bit for bit from the packed ones.

        Raises:
            ValueError: a packed projection is wrapped (a PEFT LoRA layer): restoring would drop it.
        """
        for name, _ in _packed_halves(self.family):
            child = self._modules.get(name)
            if type(child) is not PackedProjection:
                raise ValueError(
                    f"unpatch: {name} of this fused MLP is a {type(child).__name__} (a LoRA layer over the packed "
                    "weight); unpatching would drop its adapters. Merge them (peft_model.merge_and_unload()) or "
                    "remove them (unload()) first, or keep them: `with swiglu_patch.lora.adapters_aside(model): "
                    "unpatch(model)`"
                )
        original, f = self._original, self.family
        with torch.no_grad():
            tensors = self._checkpoint_tensors(keep_vars=False)
        for key, tensor in tensors.items():
            name, suffix = key.split(".")
            linear = getattr(original, name)
            requires_grad = self.gate_up_interleaved.requires_grad
            setattr(linear, suffix, nn.Parameter(tensor, requires_grad=requires_grad))
        setattr(original, f.down, self.down)
        return original


class PackedProjection(nn.Module):
    """Stands where a packed projection was (``gate_proj``, ``up_proj``, Phi-3's ``gate_up_proj``).

    It holds no parameters: its weight is its half of the fused module's ``gate_up_interleaved``.
    `weight` and `bias` return copies of that half ([I, K] and [I]; [2*I, K] and [2*I] chunked
    [gate; up] for "gate_up"), and calling it computes x @ weight^T + bias as the Linear did.
    Writes to those copies change nothing: a LoRA layer over it merges through
    `swiglu_patch.lora.PackedLoraLinear`, which writes the packed rows.

    Args:
        fused: the `FusedGatedMLP` that owns the packed weight (referenced, not a submodule).
        half: "gate", "up", or "gate_up" (both, chunked as Phi-3's checkpoint holds them).

    Attributes:
        in_features: K.
        out_features: I, or 2*I for "gate_up".
    """

    def __init__(self, fused: "FusedGatedMLP", half: str):
        super().__init__()
        if half not in ("gate", "up", "gate_up"):
            raise ValueError(f"PackedProjection: half must be 'gate', 'up' or 'gate_up', got {half!r}")
        n, k = fused.gate_up_interleaved.shape
        self.half, self.in_features, self.out_features = half, k, n if half == "gate_up" else n // 2
        object.__setattr__(self, "_fused", fused)  # not a submodule: no cycle in named_modules

    @property
    def fused(self) -> "FusedGatedMLP":
        return self._fused

    def rows(self) -> torch.Tensor:
        """int64 [out_features]: the packed row of each of this projection's output rows."""
        packed = self._fused.gate_up_interleaved
        gate, up = gate_up_rows(packed.shape[0] // 2, packed.device)
        return {"gate": gate, "up": up, "gate_up": torch.cat([gate, up])}[self.half]

    def _half(self, packed: torch.Tensor) -> torch.Tensor:
        gate, up = deinterleave_gate_up(packed)
        return {"gate": gate, "up": up}[self.half] if self.half != "gate_up" else torch.cat([gate, up])

    @property
    def weight(self) -> torch.Tensor:
        """A copy of this projection's rows of the packed weight, [out_features, K]."""
        return self._half(self._fused.gate_up_interleaved.detach())

    @property
    def bias(self) -> torch.Tensor | None:
        """A copy of this projection's entries of the packed bias, [out_features], or None."""
        b = self._fused.gate_up_interleaved_bias
        return None if b is None else self._half(b.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._fused.gate_up_interleaved_bias
        return F.linear(x, self._half(self._fused.gate_up_interleaved), None if b is None else self._half(b))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        pass  # the FusedGatedMLP above reads this projection's keys

    def extra_repr(self) -> str:
        return (
            f"{self.half} rows of the FusedGatedMLP's gate_up_interleaved, in_features={self.in_features}, "
            f"out_features={self.out_features}; no weight of its own. PEFT's get_peft_model wraps it with "
            "swiglu_patch.lora.PackedLoraLinear, in either order"
        )


# torch's global forward hooks (`register_module_forward_hook`, `..._pre_hook`), which a module's
# __call__ runs: dicts that registering a hook fills in place
_GLOBAL_FORWARD_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks)


def _down_kind(down: nn.Module) -> tuple[str, nn.Module | None, tuple[str, ...]]:
    """(kind, the nn.Linear the op runs or None, PEFT adapter names to add): kind "plain" for an
    nn.Linear run as itself, "lora" for PEFT's LoRA Linear over one (`low_rank.down_adapters`),
    "module" for anything else or while a global forward hook is set (the module runs as itself)."""
    if _GLOBAL_FORWARD_HOOKS[0] or _GLOBAL_FORWARD_HOOKS[1]:
        return "module", None, ()
    if _plain_linear(down):
        return "plain", down, ()
    found = down_adapters(down)
    if found is not None and _plain_linear(found[0]):
        return "lora", found[0], found[1]
    return "module", None, ()


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear that runs as itself: no subclass, hooks or replaced forward (a LoRA layer,
    accelerate's or tensor parallelism's wrappers go through the module instead)."""
    return (type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
            and "forward" not in m.__dict__)


def _copy_packed(param: torch.Tensor, packed: torch.Tensor) -> None:
    """param <- packed, a whole packed tensor; an FSDP2-sharded param (DTensor) takes its own rows of it."""
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        packed = distribute_tensor(packed.to(param.device, param.dtype), param.device_mesh, param.placements,
                                   src_data_rank=None)
    param.copy_(packed)


def _is_dtensor(t: torch.Tensor) -> bool:
    """A torch.distributed DTensor (FSDP2's parameters), without importing torch.distributed."""
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def _packed_halves(f: MLPFamily) -> list[tuple[str, str]]:
    """[(projection name, half)] of what the fused module packs: gate and up, or Phi-3's chunked one."""
    return [(f.gate_up_chunked, "gate_up")] if f.gate_up_chunked else [(f.gate, "gate"), (f.up, "up")]


def _split_original(mlp: nn.Module, f: MLPFamily):
    """(gate_w [I, K], up_w [I, K], gate_b [I] | None, up_b [I] | None) of an original MLP."""
    if f.gate_up_chunked:
        lin = getattr(mlp, f.gate_up_chunked)
        gate_w, up_w = lin.weight.chunk(2)
        gate_b, up_b = lin.bias.chunk(2) if lin.bias is not None else (None, None)
        return gate_w, up_w, gate_b, up_b
    gate, up = getattr(mlp, f.gate), getattr(mlp, f.up)
    return gate.weight, up.weight, gate.bias, up.bias


def _release_gate_up(mlp: nn.Module, f: MLPFamily) -> dict[tuple[str, str], nn.Parameter]:
    """Swap the original gate/up parameters for meta tensors of the same shape (frees them).

    Returns:
        {(half, suffix): the parameter taken out}, for `optimizer.mark_packed`.
    """
    consumed = {}
    for name, half in _packed_halves(f):
        lin = getattr(mlp, name)
        for suffix in ("weight", "bias"):
            p = getattr(lin, suffix)
            if p is not None:
                consumed[half, suffix] = p
                setattr(lin, suffix, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    return consumed
