"""PEFT LoRA on a patched model: adapters on gate/up ride inside the fused gated GEMM.

Either order, with the user's own `LoraConfig`:

    config = LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"])

    apply_fused_mlp(model)                   # patch, then LoRA
    model = get_peft_model(model, config)

    model = get_peft_model(model, config)    # LoRA, then patch
    apply_fused_mlp(model)

Either way ``gate_proj`` and ``up_proj`` (or Phi-3's ``gate_up_proj``) of each fused MLP are
`PackedLoraLinear` layers: PEFT's own `lora.Linear` with the same ``lora_A``/``lora_B``
parameters, keys, scaling and dropout, over a `PackedProjection` marker instead of an
nn.Linear. The fused module collects their low-rank operands (`low_rank_operands`) and runs
[x | s*x@A^T] @ [W | B]^T in one gated GEMM (`swiglu_patch.low_rank`); ``down_proj`` stays a
plain PEFT `lora.Linear`. `merge_and_unload`, `unload`, `disable_adapter`, `set_adapter`,
several adapters and `save_pretrained` of the adapter behave as with plain PEFT, and merging
writes the packed rows. The full state dict keeps plain PEFT's keys (``gate_proj.base_layer.weight``).

How each order gets there:
- patch, then LoRA: importing this module (`apply_fused_mlp` does when PEFT is installed)
  wraps PEFT's `LoraModel.inject_adapter`, which every way of adding a LoRA adapter goes
  through (`get_peft_model`, `add_adapter`, `load_adapter`, `PeftModel.from_pretrained`,
  `inject_adapter_in_model`). On a model holding packed projections it registers
  `PackedLoraLinear` for `PackedProjection` on that config (PEFT's custom-module mapping,
  `register`), lists the packed projections in ``target_modules="all-linear"`` as PEFT lists
  the nn.Linear layers, and refuses an option the fused GEMM cannot run before PEFT changes
  anything. Other tuners and models without packed projections see PEFT unchanged.
- LoRA, then patch: `apply_fused_mlp` sets PEFT's layers on the gated MLPs aside while it
  patches (`lora_layers_aside`, `adapters_aside`) and puts each back around the fused module's
  marker, the same object with the same adapters.

`adapters_aside` also unpatches a model with adapters (``with adapters_aside(model):
unpatch(model)``): the layers go back to plain `lora.Linear` over the restored nn.Linear.

Refused, each with the reason: QLoRA and other quantized bases (a bitsandbytes base under the
LoRA layer), DoRA and the other LoRA variants, ``lora_bias``, initialisations that read or
rewrite the base weight (PiSSA, OLoRA, CorDA, LoftQ, EVA, LoRA-GA, ...) on the packed
projections, and PEFT's mixed-batch ``adapter_names`` on them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

try:
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import (
        _maybe_include_all_linear_layers,
        check_adapters_to_merge,
        check_target_module_exists,
    )
except ImportError as e:  # an optional dependency
    raise ImportError(f"swiglu_patch.lora needs PEFT ({e}): pip install peft") from e

from .module import FusedGatedMLP, PackedProjection
from .registry import KNOWN_MLP_CLASSES, MLPFamily, structure_of

_INITS = (True, False, "gaussian")  # initialisations that touch only A and B


def _unsupported(config: LoraConfig) -> str | None:
    """Why an adapter of `config` cannot run inside the fused GEMM, or None."""
    if getattr(config, "use_dora", False):
        return "DoRA (use_dora=True) rescales each row of W + s*B@A by its norm, which the fused GEMM does not"
    if getattr(config, "lora_bias", False):
        return "lora_bias=True is not supported on the packed projections"
    if config.init_lora_weights not in _INITS:
        return (f"init_lora_weights={config.init_lora_weights!r} reads or rewrites the base weight; supported on "
                f"the packed projections: {_INITS} (or initialise before patching: get_peft_model on the unpatched "
                "model, then apply_fused_mlp)")
    return None


class PackedLoraLinear(LoraLinear):
    """PEFT's LoRA `Linear` over a `PackedProjection`: gate, up or Phi-3's chunked gate_up of a fused MLP.

    Its parameters, state dict keys, scaling, dropout and adapter bookkeeping are PEFT's
    (``lora_A.<adapter>.weight`` [r, K], ``lora_B.<adapter>.weight`` [out_features, r]). What
    differs: the fused module reads its update through `low_rank_operands` instead of calling
    it, and `merge`/`unmerge` write this projection's rows of the packed weight.
    """

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # a PackedProjection says them (PEFT would warn)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        reason = _unsupported(config)
        if reason:
            raise ValueError(f"swiglu_patch.lora: cannot add adapter {adapter_name!r} to a packed projection: {reason}")
        if self.resolve_lora_variant(config=config) is not None:
            raise ValueError(f"swiglu_patch.lora: cannot add adapter {adapter_name!r} to a packed projection: LoRA "
                             "variants (DoRA, aLoRA, Arrow, ...) are not supported by the fused GEMM")
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)

    def low_rank_operands(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """[(x_lr [..., r], b, half)] of each active, unmerged adapter, in x's dtype.

        x_lr = scaling * lora_A(dropout(x)) (x cast to lora_A's dtype first, as PEFT does);
        b = lora_B's weight ([I, r]; [2*I, r] on a chunked gate_up_proj) and half the packed
        rows it updates, which `low_rank.pack_low_rank_bs` lays out.
        """
        half = self.get_base_layer().half
        out = []
        for adapter in self._adapters_to_add():
            a, b = self.lora_A[adapter], self.lora_B[adapter]
            x_lr = a(self.lora_dropout[adapter](self._cast_input_dtype(x, a.weight.dtype))) * self.scaling[adapter]
            out.append((x_lr.to(x.dtype), b.weight.to(x.dtype), half))
        return out

    def low_rank_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, float, str]] | None:
        """[(A [r, K], B [I, r] (or [2*I, r] chunked), scaling, half)] of each active, unmerged adapter,
        for a call in which dropout does nothing; None if an adapter's dropout is active (training
        mode with p > 0) or its A/B is not a plain linear layer: the caller then takes
        `low_rank_operands`, which runs them as PEFT does."""
        modules = self._modules  # direct reads: nn.Module.__getattr__ costs host time on this per-call path
        base = modules["base_layer"]
        half = base.half if type(base) is PackedProjection else self.get_base_layer().half
        lora_a, lora_b, dropout = (modules[n]._modules for n in ("lora_A", "lora_B", "lora_dropout"))
        out = []
        for adapter in self._adapters_to_add():
            a, b, drop = lora_a[adapter], lora_b[adapter], dropout[adapter]
            if type(a) is not nn.Linear or type(b) is not nn.Linear:
                return None
            a, b = a._parameters, b._parameters
            if a["bias"] is not None or b["bias"] is not None or (
                    type(drop) is not nn.Identity and drop.training and drop.p):
                return None
            out.append((a["weight"], b["weight"], self.scaling[adapter], half))
        return out

    def _adapters_to_add(self) -> list[str]:
        """The active, unmerged adapters' names (a disabled, merged one is unmerged first, as PEFT's forward does)."""
        if self.disable_adapters:
            if self.merged:  # as PEFT's forward: a disabled adapter is taken out of the weight
                self.unmerge()
            return []
        if self.merged:
            return []
        if self._forward_pre_hooks or self._forward_hooks:
            raise NotImplementedError(
                "swiglu_patch.lora: a hook on a packed projection's LoRA layer would not run inside the fused GEMM "
                "(PEFT's mixed-batch adapter_names= works this way); merge the adapter or unpatch for that call"
            )
        lora_a = self._modules["lora_A"]._modules
        return [a for a in self.active_adapters if a in lora_a]

    def _packed_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the packed weight parameter, this projection's row indices in it)."""
        marker = self.get_base_layer()
        packed = marker.fused.gate_up_interleaved
        if type(packed.data) is not torch.Tensor:
            raise NotImplementedError(
                f"swiglu_patch.lora: merging into a sharded packed weight ({type(packed.data).__name__}) is not "
                "supported; merge before sharding, or gather the model's full state dict first"
            )
        return packed, marker.rows()

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add s * B @ A of each adapter to this projection's rows of the packed weight (as PEFT's Linear does)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        packed, rows = self._packed_rows()
        for adapter in adapter_names:
            if adapter not in self.lora_A.keys():
                continue
            weight = packed.data[rows]  # the projection's weight, bit for bit
            if safe_merge:
                weight += self.get_delta_weight(adapter).to(weight.dtype)
                if not torch.isfinite(weight).all():
                    raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
            else:
                weight += self.get_delta_weight(adapter)
            packed.data[rows] = weight
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        """Subtract the merged adapters from the packed rows again, last merged first."""
        if not self.merged:
            return
        packed, rows = self._packed_rows()
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A.keys():
                weight = packed.data[rows]
                weight -= self.get_delta_weight(adapter).to(weight.dtype)
                packed.data[rows] = weight


def register(config: LoraConfig) -> LoraConfig:
    """Register `PackedLoraLinear` for `PackedProjection` on `config` (PEFT's custom-module mapping).

    Not needed with `get_peft_model` and the other PEFT entry points, which do it themselves on
    a patched model (see the module docstring); kept for code that builds LoRA layers outside
    `LoraModel`. The config's saved form (``adapter_config.json``) is unchanged.

    Args:
        config: a `peft.LoraConfig`.

    Returns:
        The same config, registered.

    Raises:
        TypeError: not a LoraConfig.
        ValueError: an option the fused GEMM cannot run (`_unsupported`).
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"swiglu_patch.lora.register: expected a peft.LoraConfig, got {type(config).__name__}")
    reason = _unsupported(config)
    if reason:
        raise ValueError(f"swiglu_patch.lora.register: {reason}")
    config._register_custom_module({PackedProjection: PackedLoraLinear})
    return config


# -- patch, then LoRA: PEFT's injection learns the packed projections ---------------------------


def fit_config(config: LoraConfig, model: nn.Module) -> None:
    """Make a LoRA config fit a model holding packed projections, before PEFT injects it.

    Lists the packed projections in ``target_modules="all-linear"`` (PEFT lists nn.Linear
    layers, which the markers are not), refuses an option the fused GEMM cannot run when the
    config targets a packed projection, and registers `PackedLoraLinear` for them. A model
    without packed projections is left alone.

    Args:
        config: the LoraConfig PEFT is about to inject.
        model: the model it injects into.

    Raises:
        ValueError: the config targets a packed projection with DoRA or another LoRA variant,
            ``lora_bias`` or an initialisation that reads the base weight; nothing is changed.
    """
    markers = [path.removesuffix(".base_layer") for path, m in model.named_modules() if isinstance(m, PackedProjection)]
    if not markers:
        return
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        _maybe_include_all_linear_layers(config, model)  # PEFT's own list: nn.Linear layers and LoRA ones
        config.target_modules = set(config.target_modules) | set(markers)
    targeted = [path for path in markers if check_target_module_exists(config, path)]
    reason = _unsupported(config) if targeted else None
    if reason:
        raise ValueError(
            f"swiglu_patch.lora: cannot put this LoRA adapter on {targeted[0]}, a projection packed by "
            f"apply_fused_mlp: {reason}. Leave gate/up out of target_modules, or unpatch first "
            "(swiglu_patch.unpatch(model)) and train it with plain PEFT"
        )
    config._register_custom_module({PackedProjection: PackedLoraLinear})


def _inject_adapter(self, model, adapter_name, *args, **kwargs):
    """PEFT's `LoraModel.inject_adapter`, after `fit_config` of the adapter's config."""
    config = self.peft_config[adapter_name]
    if type(self) is LoraModel and isinstance(config, LoraConfig):
        fit_config(config, model)
    return _inject_adapter.peft(self, model, adapter_name, *args, **kwargs)


if getattr(LoraModel.inject_adapter, "peft", None) is None:  # once per process
    _inject_adapter.peft = LoraModel.inject_adapter
    LoraModel.inject_adapter = _inject_adapter


# -- LoRA, then patch: PEFT's layers set aside while the MLPs are fused -------------------------


def _quantized_base(layer: LoraLayer) -> str | None:
    base = layer.get_base_layer()
    if type(base).__module__.split(".")[0] == "bitsandbytes" or hasattr(getattr(base, "weight", None), "quant_state"):
        return type(base).__name__
    return None


_FIX = "merge the adapters into the base first (peft_model.merge_and_unload()), or train it without swiglu-patch"


def _check_wrapper(path: str, layer: LoraLayer) -> None:
    if type(layer) not in (LoraLinear, PackedLoraLinear):
        raise ValueError(f"swiglu_patch.lora: {path} is a {type(layer).__module__}.{type(layer).__name__}; the fused "
                         f"GEMM runs PEFT's lora.Linear on gate/up only: {_FIX}")
    if layer.lora_variant:
        raise ValueError(f"swiglu_patch.lora: {path} uses a LoRA variant ({', '.join(layer.lora_variant)}: "
                         f"{type(next(iter(layer.lora_variant.values()))).__name__}), which the fused GEMM cannot "
                         f"run: {_FIX}")
    if any(layer.lora_bias.values()):
        raise ValueError(f"swiglu_patch.lora: {path} has lora_bias=True, which the packed projections do not "
                         f"support: {_FIX}")


def _gated_family(module: nn.Module) -> MLPFamily | None:
    """Where `module` keeps its projections if it is a gated MLP (fused or not), else None."""
    if isinstance(module, FusedGatedMLP):
        return module.family
    family = KNOWN_MLP_CLASSES.get(type(module).__name__)
    return family if family is not None else structure_of(module)


def _gated_lora_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """[(path, layer)] of the PEFT LoRA layers to set aside: those on gate/up of a gated MLP (checked),
    and plain `lora.Linear` ones on its down projection.

    Raises:
        ValueError: a LoRA layer over a bitsandbytes base (QLoRA), or gate/up LoRA the fused GEMM
            cannot run (a LoRA variant, lora_bias, another LoRA layer class).
    """
    found = []
    for parent_path, parent in model.named_modules():
        family = None
        for name, child in parent._modules.items():
            if not isinstance(child, LoraLayer):
                continue
            family = family or _gated_family(parent)
            if family is None or name not in family.projections:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            quantized = _quantized_base(child)
            if quantized:
                raise ValueError(
                    f"swiglu_patch.lora: {path} is a LoRA layer over a bitsandbytes {quantized} base (QLoRA). The "
                    "fused gated GEMM reads bf16/fp16/fp32 weights, so QLoRA is not supported: load the base model "
                    "in bf16 (no quantization_config) to patch it, or train QLoRA without swiglu-patch"
                )
            if name in family.packed:
                _check_wrapper(path, child)
                found.append((path, child))
            elif type(child) is LoraLinear:
                found.append((path, child))
    return found


@contextmanager
def adapters_aside(model: nn.Module):
    """Patch or unpatch a model that PEFT has wrapped, keeping its LoRA layers on the gated MLPs.

    `apply_fused_mlp` does this itself; `unpatch` of a model with adapters needs it
    (``with adapters_aside(model): unpatch(model)``). On entry every PEFT LoRA layer on gate/up
    and every plain `lora.Linear` on down of a gated MLP is replaced by its base layer; on exit
    each goes back around whatever stands at its place then: a `PackedLoraLinear` around a
    `PackedProjection` (after `apply_fused_mlp`), a plain `lora.Linear` around an nn.Linear
    (after `unpatch`, or where nothing was patched). The layers keep their identity, so their
    parameters, adapters, merged state and an optimizer's references to them are unchanged.
    LoRA layers elsewhere (attention, embeddings) are not touched.

    Args:
        model: a PEFT model, or any module holding PEFT LoRA layers.

    Raises:
        ValueError: a LoRA layer over a bitsandbytes (4-bit or 8-bit) base at a gated MLP's
            projection (QLoRA), a LoRA variant (DoRA, ...) or lora_bias on gate/up; nothing is changed.
    """
    aside = _gated_lora_layers(model)
    for path, layer in aside:
        _set(model, path, layer.base_layer)
    try:
        yield
    finally:
        for path, layer in aside:
            _rebase(path, layer, model.get_submodule(path))
            _set(model, path, layer)


def lora_layers_aside(model: nn.Module):
    """`adapters_aside(model)` when PEFT LoRA layers sit on `model`'s gated MLPs, else None
    (what `apply_fused_mlp` patches a PEFT model under).

    Raises:
        ValueError: as `adapters_aside`.
    """
    return adapters_aside(model) if _gated_lora_layers(model) else None


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _rebase(path: str, layer: LoraLinear, base: nn.Module) -> None:
    """Put `base` under `layer`, turning it into the LoRA class for that base (same object, same adapters)."""
    if (layer.in_features, layer.out_features) != (base.in_features, base.out_features):
        raise ValueError(
            f"swiglu_patch.lora: {path} now holds {type(base).__name__} [{base.out_features}, {base.in_features}], "
            f"but its LoRA layer was built for [{layer.out_features}, {layer.in_features}]"
        )
    # The two classes hold the same state (PackedLoraLinear adds methods only), so a class
    # swap carries every adapter, its merged state and any reference to its parameters.
    layer.__class__ = PackedLoraLinear if isinstance(base, PackedProjection) else LoraLinear
    layer.base_layer = base
