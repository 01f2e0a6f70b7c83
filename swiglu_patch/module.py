"""`FusedGatedMLP`: the module that replaces a gated MLP once it is patched.

It holds the packed ``gate_up_interleaved`` weight [2*I, K] (and bias [2*I] when the MLP
had biases), the MLP's own down projection under its original name (``down_proj``, LFM2's
``w2``), and the original MLP module with its gate and up weights moved to the meta device
(no memory), kept to be put back by `unpatch`.

Its state dict speaks the original checkpoint's language: `state_dict()` writes
``gate_proj.weight`` / ``up_proj.weight`` (or Phi-3's chunked ``gate_up_proj.weight``)
unpacked, and `load_state_dict` reads those keys and packs them, so `save_pretrained`
gives a plain transformers checkpoint and an original checkpoint loads into a patched model.

Under the names of the projections it packed (``gate_proj``, ``up_proj``) it holds
`PackedAway` markers: modules with no weights whose only job is to answer a tool that looks
them up by name (PEFT's ``target_modules``) with an error that says what happened to them.
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import gated_linear_interleaved
from .kernels.epilogue import GatedEpilogue
from .kernels.layout import deinterleave_gate_up, interleave_gate_up
from .registry import MLPFamily


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
        self.add_module(family.down, getattr(original, family.down))  # the checkpoint's name (LFM2: w2)
        self.epilogue = GatedEpilogue.of(epilogue)
        self.backend = backend
        self.family = family
        for name in family.packed:
            self.add_module(name, PackedAway(name, family))
        _release_gate_up(original, family)
        object.__setattr__(self, "_original", original)  # not a submodule: not in params or state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gated_linear_interleaved(x, self.gate_up_interleaved, self.gate_up_interleaved_bias, self.epilogue,
                                     self.backend)
        return self.down(h)

    @property
    def down(self) -> nn.Module:
        """The original down projection (registered under its own name, `family.down`)."""
        return self._modules[self.family.down]

    def extra_repr(self) -> str:
        n, k = self.gate_up_interleaved.shape
        return (
            f"hidden_size={k}, intermediate_size={n // 2}, epilogue={self.epilogue.describe()!r}, "
            f"bias={self.gate_up_interleaved_bias is not None}, backend={self.backend!r}, "
            f"original={type(self._original).__name__}"
        )

    # -- the original checkpoint's keys --------------------------------------------------

    def _checkpoint_tensors(self, keep_vars: bool) -> dict[str, torch.Tensor]:
        """{local key: tensor} in the original module's layout."""
        f = self.family
        out = {}
        for suffix, packed in (("weight", self.gate_up_interleaved), ("bias", self.gate_up_interleaved_bias)):
            if packed is None:
                continue
            gate, up = deinterleave_gate_up(packed if keep_vars else packed.detach())
            if f.gate_up_chunked:
                out[f"{f.gate_up_chunked}.{suffix}"] = torch.cat([gate, up])
            else:
                out[f"{f.gate}.{suffix}"], out[f"{f.up}.{suffix}"] = gate, up
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, tensor in self._checkpoint_tensors(keep_vars).items():
            destination[prefix + key] = tensor

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for hook in self._load_state_dict_pre_hooks.values():  # as nn.Module's own does (tensor_parallel's uses it)
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        f = self.family
        names = [f.gate_up_chunked] if f.gate_up_chunked else [f.gate, f.up]
        for suffix, param in (("weight", self.gate_up_interleaved), ("bias", self.gate_up_interleaved_bias)):
            if param is None:
                continue
            keys = [f"{prefix}{name}.{suffix}" for name in names]
            missing = [k for k in keys if k not in state_dict]
            if missing:
                missing_keys.extend(missing)
                continue
            tensors = [state_dict[k] for k in keys]
            gate, up = tensors if len(tensors) == 2 else tensors[0].chunk(2)
            if 2 * gate.shape[0] != param.shape[0] or gate.shape[1:] != param.shape[1:] or gate.shape != up.shape:
                error_msgs.append(
                    f"size mismatch for {keys}: checkpoint has {[tuple(t.shape) for t in tensors]}, the fused "
                    f"module packs them into {tuple(param.shape)}"
                )
                continue
            with torch.no_grad():
                param.copy_(interleave_gate_up(gate.to(param.device, param.dtype), up.to(param.device, param.dtype)))
        if strict:
            known = set(self._modules)
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :].split(".", 1)[0] not in known:
                    unexpected_keys.append(key)

    # -- back to the original ------------------------------------------------------------

    def restore(self) -> nn.Module:
        """The original MLP module, with gate/up weights unpacked bit for bit from the packed ones."""
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


class PackedAway(nn.Module):
    """Stands where a packed projection was (``gate_proj``, ``up_proj``): no weights, no forward.

    A tool that finds modules by name (PEFT's LoRA ``target_modules``) reaches this marker
    instead of silently skipping the projection, and its error shows this module's repr,
    which says what happened and what to do.
    """

    def __init__(self, name: str, family: MLPFamily):
        super().__init__()
        others = [n for n in family.packed if n != name]
        self.name, self.down = name, family.down
        self.packed = f"{name} is packed" + (f" with {', '.join(others)}" if others else "")

    def extra_repr(self) -> str:
        return (
            f"{self.packed} into this FusedGatedMLP's gate_up_interleaved by swiglu-patch; it has no weight of "
            "its own, so LoRA/PEFT cannot wrap it: call swiglu_patch.unpatch(model) before "
            f"get_peft_model, or target only {self.down}"
        )

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"PackedAway: {self.extra_repr()}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        pass  # the FusedGatedMLP above reads this projection's keys


def _split_original(mlp: nn.Module, f: MLPFamily):
    """(gate_w [I, K], up_w [I, K], gate_b [I] | None, up_b [I] | None) of an original MLP."""
    if f.gate_up_chunked:
        lin = getattr(mlp, f.gate_up_chunked)
        gate_w, up_w = lin.weight.chunk(2)
        gate_b, up_b = lin.bias.chunk(2) if lin.bias is not None else (None, None)
        return gate_w, up_w, gate_b, up_b
    gate, up = getattr(mlp, f.gate), getattr(mlp, f.up)
    return gate.weight, up.weight, gate.bias, up.bias


def _release_gate_up(mlp: nn.Module, f: MLPFamily) -> None:
    """Swap the original gate/up parameters for meta tensors of the same shape (frees them)."""
    for name in f.packed:
        lin = getattr(mlp, name)
        for suffix in ("weight", "bias"):
            p = getattr(lin, suffix)
            if p is not None:
                setattr(lin, suffix, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
