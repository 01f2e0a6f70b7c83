"""`PatchReport`: what `apply_fused_mlp` found and did, for every gated module of the model."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kernels.epilogue import GatedEpilogue

@dataclass(frozen=True)
class NotPatched:
    """A gated module left as it is.

    Attributes:
        name: its qualified name in the model.
        module_class: its class name.
        reason: why it was not replaced.
    """

    name: str
    module_class: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.module_class}): {self.reason}"


@dataclass
class PatchReport:
    """Every gated module of a model: replaced, or left with the reason.

    Attributes:
        model_type: the model's ``config.model_type`` (None without a config).
        patched: names of the modules replaced by a `FusedGatedMLP`, and of the MoE experts
            modules switched to the fused experts kernels (`experts`).
        epilogues: module name -> the `GatedEpilogue` its fused module runs.
        experts: experts module name -> the `ExpertsSpec` it runs (`swiglu_patch.experts`).
        by_structure: the patched ones whose class is not in the registry (matched by
            structure and shown equal by the numeric probe).
        not_patched: every gated module left as it is, with the reason (MoE experts included).
        already_patched: names of modules fused before this call.
        probes: how many numeric probes ran (one per class and setting).
        trainable: the patched weights require grad (an optimizer must be built after patching).
        training: the model was in training mode; with `trainable`, the text and a warning say
            so (from_pretrained returns eval mode with weights that require grad: inference
            patches stay quiet).
    """

    model_type: str | None = None
    patched: list[str] = field(default_factory=list)
    epilogues: dict[str, GatedEpilogue] = field(default_factory=dict)
    experts: dict[str, object] = field(default_factory=dict)
    by_structure: list[str] = field(default_factory=list)
    not_patched: list[NotPatched] = field(default_factory=list)
    already_patched: list[str] = field(default_factory=list)
    probes: int = 0
    trainable: bool = False
    training: bool = False

    @property
    def activations(self) -> dict[str, str]:
        """Module name -> kernel activation of the patched modules."""
        return {name: e.activation for name, e in self.epilogues.items()}

    @property
    def has_gated_mlp(self) -> bool:
        """False only when the model holds no gated module at all."""
        return bool(self.patched or self.not_patched or self.already_patched)

    def __str__(self) -> str:
        if not self.has_gated_mlp:
            return f"apply_fused_mlp: model_type {self.model_type!r} has no gated MLP"
        kinds = sorted({e.describe() for e in self.epilogues.values()})
        mlps = len(self.patched) - len(self.experts)
        lines = [f"apply_fused_mlp: patched {mlps} MLP(s)" + (f" ({'; '.join(kinds)})" if kinds else "")
                 + (f" and {len(self.experts)} MoE experts module(s)" if self.experts else "")
                 + f", {len(self.not_patched)} gated module(s) left as they are"]
        for spec in sorted({s.describe() for s in self.experts.values()}):
            lines.append(f"  experts on the fused experts kernels: {spec}")
        if self.by_structure:
            lines.append(f"  {len(self.by_structure)} patched by structure (class not in the registry, shown equal by "
                         "the numeric probe): " + ", ".join(self.by_structure[:3]) + (" ..." if len(self.by_structure) > 3 else ""))
        if self.already_patched:
            lines.append(f"  {len(self.already_patched)} already patched, left as they were")
        groups: dict[tuple[str, str], list[str]] = {}
        for item in self.not_patched:
            groups.setdefault((item.module_class, item.reason), []).append(item.name)
        for (cls, reason), names in groups.items():
            where = names[0] if len(names) == 1 else f"{len(names)} modules: {names[0]}, ..., {names[-1]}"
            lines.append(f"  not patched: {cls} ({where}): {reason}")
        if self.trainable and self.training:
            lines.append("  the patched weights require grad: build the optimizer after patching (gate_up_interleaved "
                         "replaces gate/up parameters)")
        return "\n".join(lines)
