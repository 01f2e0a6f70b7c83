"""Patching a gated MLP that transformers sharded with tensor parallelism (``tp_plan``).

What a rank holds after ``from_pretrained(path, tp_plan="auto")`` under ``torchrun`` (transformers
5.x, any backend, gloo on CPU included), for the ``colwise``/``rowwise`` plan of every family in
the registry except Phi-3:

- ``gate_proj.weight``, ``up_proj.weight``: DTensors [I, K] placed ``Shard(0)`` on a 1-D mesh of
  tp ranks; rank r's local tensor is rows r*I/tp .. (r+1)*I/tp - 1 ([I/tp, K]). Biases ``Shard(0)``.
- ``down_proj.weight``: a DTensor [K, I] placed ``Shard(1)``; local [K, I/tp]. Bias ``Replicate()``.
- Each Linear's ``forward`` replaced by transformers' style: gate/up (``ColwiseParallel``) take the
  replicated input x as a plain tensor and return their local [..., I/tp] output; down_proj
  (``RowwiseParallel``) takes that local slice and all-reduces its partial [..., K] output.

Patching on each rank (`localize`, then `FusedGatedMLP`, then `attach`):

- the local gate and up rows are packed into a local ``gate_up_interleaved`` [2*I/tp, K], a plain
  tensor. When I/tp is a multiple of GATE_UP_BLOCK these are exactly rows r*2I/tp ..
  (r+1)*2I/tp - 1 of the global packed weight ``pack_gate_up(gate, up).weight``: the rank's column
  shard of it, so one layout means the same thing at every tp. Otherwise a column shard of the
  global packed weight would cut a block between its gate and up rows, and patching is refused
  (`check_sharding`);
- nothing is gathered: extra memory is one layer's local packed weight until its local gate/up
  shards are freed;
- the fused module runs the kernel on the local input and weight; ``down_proj`` keeps its DTensor
  weight and transformers' row-wise all-reduce;
- ``state_dict()`` writes gate/up as DTensors with their original placements, so transformers'
  ``save_pretrained`` gathers them into the original checkpoint; `restore_sharding` puts the
  DTensors back bit for bit on unpatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .kernels.layout import GATE_UP_BLOCK
from .registry import MLPFamily

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

if dist.is_available():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
else:  # a torch build without distributed: nothing can be sharded
    DTensor = None

try:  # transformers >= 5.17 keeps the styles in transformers.distributed
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel
except ImportError:  # older layouts of transformers, or no torch.distributed
    try:
        from transformers.integrations.tensor_parallel import ColwiseParallel, RowwiseParallel
    except ImportError:
        ColwiseParallel = RowwiseParallel = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


# -- which tp degrees keep whole blocks ------------------------------------------------------------


def working_degrees(intermediate: int, up_to: int) -> list[int]:
    """Tensor-parallel degrees 2 .. up_to at which every rank holds whole gate/up blocks.

    Args:
        intermediate: I, the MLP's intermediate_size.
        up_to: the largest degree to list.

    Returns:
        The degrees d with I % (GATE_UP_BLOCK * d) == 0, ascending.
    """
    return [d for d in range(2, up_to + 1) if intermediate % (GATE_UP_BLOCK * d) == 0]


def degree_error(intermediate: int, tp: int) -> str | None:
    """Why I cannot be sharded tp ways in the packed layout, with the nearest degrees that work; None if it can."""
    if tp == 1 or intermediate % (GATE_UP_BLOCK * tp) == 0:
        return None
    rows = f"{intermediate // tp}" if intermediate % tp == 0 else f"{intermediate / tp:.4g} (uneven)"
    reason = (
        f"intermediate_size I={intermediate} over tp={tp} ranks gives {rows} gate/up rows per rank, not a "
        f"multiple of {GATE_UP_BLOCK} (the packed layout's block): a column shard of the packed weight would "
        "separate a gate row from its up row"
    )
    if intermediate % GATE_UP_BLOCK:
        return (
            f"{reason}. No tp > 1 works, since I={intermediate} is not a multiple of {GATE_UP_BLOCK}: load the "
            "model without tp_plan to patch it, or leave it unpatched"
        )
    degrees = working_degrees(intermediate, intermediate // GATE_UP_BLOCK)
    below = [d for d in degrees if d < tp]
    above = [d for d in degrees if d > tp]
    nearest = ([f"{below[-1]}"] if below else []) + ([f"{above[0]}"] if above else [])
    return (
        f"{reason}. The nearest degrees that work for I={intermediate}: {' and '.join(nearest) or 'none'}; "
        "restart torchrun with --nproc-per-node set to one of them (or tp_size in DistributedConfig)"
    )


# -- the check --------------------------------------------------------------------------------------


def _names(family: MLPFamily) -> tuple[list[str], str]:
    return ([family.gate_up_chunked] if family.gate_up_chunked else [family.gate, family.up]), family.down


def _style(linear: nn.Module):
    """The transformers tensor-parallel style installed on `linear`'s forward, or None.

    transformers (5.x) installs a style by replacing the module's ``forward`` with a closure over
    the style object; the style says how the module takes its input and gives its output.
    """
    forward = vars(linear).get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            obj = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if ColwiseParallel is not None and isinstance(obj, (ColwiseParallel, RowwiseParallel)):
            return obj
    return None


def _is_shard(placement, dim: int, ndim: int) -> bool:
    return type(placement) is Shard and placement.dim % ndim == dim % ndim


def _is_last_dim_shard(placement) -> bool:
    return type(placement) is Shard and placement.dim in (-1, 1)


def check_sharding(module: nn.Module, family: MLPFamily) -> bool:
    """Whether `module`'s projections are tensor-parallel, after checking the fused MLP can run them.

    Args:
        module: a gated MLP (an HF module with gate/up/down nn.Linear).
        family: where its projections live.

    Returns:
        False if no gate/up/down weight or bias is a DTensor; True if they are all sharded the
        way the fused MLP runs (transformers' ``colwise`` gate/up, ``rowwise`` down, one 1-D mesh,
        I a multiple of GATE_UP_BLOCK * tp).

    Raises:
        ValueError: sharded in any other way; the message names the projection, what was
            expected and what came, and for a tp that does not divide I into whole blocks, the
            nearest degrees that work.
    """
    gate_up, down = _names(family)
    tensors = {
        f"{name}.{suffix}": getattr(getattr(module, name), suffix, None)
        for name in gate_up + [down]
        for suffix in ("weight", "bias")
    }
    tensors = {key: t for key, t in tensors.items() if t is not None}
    sharded = [key for key, t in tensors.items() if is_dtensor(t)]
    if not sharded:
        return False
    if family.gate_up_chunked:
        raise ValueError(
            f"{family.gate_up_chunked} is a tensor-parallel chunked [gate; up] weight: a column shard gives a "
            "rank gate rows or up rows, not both (Phi-3's tp_plan gathers its output and splits down_proj's "
            "input instead). Only the colwise gate_proj/up_proj + rowwise down_proj plan is supported; load "
            "the model without tp_plan to patch it"
        )
    plain = [key for key in tensors if key not in sharded]
    if plain:
        raise ValueError(
            f"{', '.join(sharded)} are DTensors but {', '.join(plain)} are plain tensors; the fused MLP needs "
            "gate, up and down all sharded by one tp_plan"
        )
    if ColwiseParallel is None:
        raise ValueError(
            "the projections are DTensors but this transformers has no tensor-parallel styles "
            "(transformers.distributed.tensor_parallel) to check them against; upgrade transformers to 5.x"
        )
    mesh = tensors[f"{down}.weight"].device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"the projections are sharded on a {mesh.ndim}-D device mesh {mesh}; the fused MLP supports tensor "
            "parallelism on a 1-D mesh only (no FSDP or data-parallel mesh dims over the MLP)"
        )
    for key in sharded:
        if tensors[key].device_mesh != mesh:
            raise ValueError(f"{key} is on device mesh {tensors[key].device_mesh}, {down}.weight on {mesh}")
    for key in sharded:
        t, placements = tensors[key], tensors[key].placements
        if key.startswith(down):
            ok = _is_last_dim_shard(placements[0]) if key.endswith("weight") else placements[0].is_replicate()
            want = "Shard(1) (row-wise)" if key.endswith("weight") else "Replicate()"
        else:
            ok, want = _is_shard(placements[0], 0, t.ndim), "Shard(0) (column-wise)"
        if not ok:
            raise ValueError(f"{key} is placed {placements}; the fused MLP needs {want}, as tp_plan 'colwise' "
                             "gate/up and 'rowwise' down give")
    for name in gate_up:
        style = _style(getattr(module, name))
        if not (isinstance(style, ColwiseParallel) and style.input_layouts == Replicate()
                and _is_last_dim_shard(style.output_layouts)):
            raise ValueError(
                f"{name}'s tensor-parallel style is {_describe(style)}; the fused MLP computes on a replicated "
                "input and gives down_proj its local slice, which is tp_plan 'colwise' (ColwiseParallel with "
                "input Replicate(), output Shard(-1))"
            )
    style = _style(getattr(module, down))
    if not (isinstance(style, RowwiseParallel) and _is_last_dim_shard(style.input_layouts)
            and style.output_layouts == Replicate()):
        raise ValueError(
            f"{down}'s tensor-parallel style is {_describe(style)}; the fused MLP hands it the rank's local "
            "[..., I/tp] slice, which needs tp_plan 'rowwise' (RowwiseParallel with input Shard(-1), output "
            "Replicate())"
        )
    if "forward" in vars(module) and getattr(module, "_hf_hook", None) is None:
        raise ValueError(
            "the MLP module itself carries a tensor-parallel style (its forward is wrapped); patching would drop "
            "it. Only styles on gate_proj/up_proj/down_proj are supported"
        )
    error = degree_error(tensors[f"{gate_up[0]}.weight"].shape[0], mesh.size())
    if error:
        raise ValueError(error)
    return True


def _describe(style) -> str:
    if style is None:
        return "unknown (no transformers ColwiseParallel/RowwiseParallel found on its forward)"
    return (f"{type(style).__name__}(input_layouts={getattr(style, 'input_layouts', None)!r}, "
            f"output_layouts={getattr(style, 'output_layouts', None)!r})")


# -- local shards in, DTensors out ------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """How one gate/up parameter was sharded: what it takes to wrap its local tensor back.

    Attributes:
        mesh: the 1-D tensor-parallel device mesh.
        placements: the DTensor's placements (``(Shard(0),)`` for gate/up).
        shape, stride: the global shape and stride ([I, K] or [I]).
        local_shape: this rank's local shape ([I/tp, K] or [I/tp]).
        offset: the first global row this rank holds (shards are even: `check_sharding` asks
            I % (16 * tp) == 0).
    """

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: torch.Size
    offset: int

    @classmethod
    def of(cls, param) -> ShardSpec:
        local = param.to_local()
        rows = local.shape[0]
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride(), local.shape,
                   param.device_mesh.get_local_rank() * rows)

    def wrap(self, local: torch.Tensor):
        """`local` ([local_shape]) as a DTensor with the original mesh, placements, shape and stride."""
        if local.shape != self.local_shape:
            raise ValueError(f"local shard has shape {tuple(local.shape)}, expected {tuple(self.local_shape)}")
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)

    def local_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [shape] tensor or of a DTensor of the same global shape."""
        if tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"expected the full tensor {tuple(self.shape)} or a DTensor of that global shape, got "
                             f"{type(tensor).__name__} {tuple(tensor.shape)}")
        if is_dtensor(tensor):
            if tensor.device_mesh != self.mesh or tuple(tensor.placements) != self.placements:
                tensor = tensor.redistribute(self.mesh, self.placements)
            return tensor.to_local()
        return tensor[self.offset : self.offset + self.local_shape[0]]


@dataclass(frozen=True)
class TensorParallelMLP:
    """What `localize` took from a sharded MLP, kept on the fused module to undo it.

    Attributes:
        specs: parameter key relative to the MLP ("gate_proj.weight", "up_proj.bias", ...) ->
            its `ShardSpec`.
        mesh: the tensor-parallel mesh.
    """

    specs: dict[str, ShardSpec]
    mesh: DeviceMesh


def localize(module: nn.Module, family: MLPFamily) -> TensorParallelMLP | None:
    """Swap `module`'s gate/up DTensor parameters for their local shards, ready to be packed.

    The local tensors share the DTensors' storage (no copy). For a sharded MLP, call it only
    after `check_sharding` returned True, and build the `FusedGatedMLP` from `module` right after.

    Args:
        module: a gated MLP whose projections passed `check_sharding`.
        family: where its projections live.

    Returns:
        The record `attach` and `restore_sharding` need, or None if `module` is not sharded.
    """
    gate_up, down = _names(family)
    if not is_dtensor(getattr(module, down).weight):
        return None
    specs = {}
    for name in gate_up:
        linear = getattr(module, name)
        for suffix in ("weight", "bias"):
            p = getattr(linear, suffix)
            if p is not None:
                specs[f"{name}.{suffix}"] = ShardSpec.of(p)
                setattr(linear, suffix, nn.Parameter(p.to_local(), requires_grad=p.requires_grad))
    return TensorParallelMLP(specs, getattr(module, down).weight.device_mesh)


if DTensor is not None:

    class _AllReduceGrad(torch.autograd.Function):
        """Identity forward; backward sums the input gradient over the mesh (each rank's is partial)."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None


class _ReplicatedInput:
    """Forward pre-hook: the fused MLP's input as this rank's plain, replicated tensor.

    A plain tensor is the replicated input already (as ColwiseParallel's ``input_layouts``
    says); a DTensor is redistributed to ``Replicate()``. When autograd records, the input's
    gradient from this rank's slice of I is partial, so it is all-reduced in backward.
    """

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        if is_dtensor(x):
            x = x.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        elif torch.is_grad_enabled() and x.requires_grad:
            x = _AllReduceGrad.apply(x, self.mesh.get_group())
        if args:
            return (x,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "x": x}


def attach(fused: nn.Module, record: TensorParallelMLP | None) -> None:
    """Make a `FusedGatedMLP` built from a `localize`d MLP run and save as a tensor-parallel module.

    Installs on `fused`: a forward pre-hook giving the kernel the local replicated input; a
    state-dict post-hook writing gate/up as DTensors with their original placements (which
    ``save_pretrained`` gathers); a load pre-hook taking this rank's rows of full tensors or
    DTensors. Keeps `record` for `restore_sharding`. Does nothing when `record` is None.
    """
    if record is None:
        return
    fused.register_forward_pre_hook(_ReplicatedInput(record.mesh), with_kwargs=True)
    fused.register_state_dict_post_hook(_wrap_state_dict)
    fused.register_load_state_dict_pre_hook(_localize_state_dict)
    fused.tensor_parallel = record


def _wrap_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for key, spec in module.tensor_parallel.specs.items():
        if prefix + key in state_dict:
            state_dict[prefix + key] = spec.wrap(state_dict[prefix + key])


def _localize_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    for key, spec in module.tensor_parallel.specs.items():
        if prefix + key in state_dict:
            try:
                state_dict[prefix + key] = spec.local_of(state_dict[prefix + key])
            except ValueError as e:
                error_msgs.append(f"{prefix + key} (tensor-parallel, tp={spec.mesh.size()}): {e}")
                del state_dict[prefix + key]


def restore_sharding(fused: nn.Module, original: nn.Module) -> None:
    """After ``fused.restore()`` gave back `original`, wrap its local gate/up into the original DTensors.

    Does nothing for a fused module that was not tensor-parallel.
    """
    record = getattr(fused, "tensor_parallel", None)
    if record is None:
        return
    for key, spec in record.specs.items():
        name, suffix = key.split(".")
        linear = getattr(original, name)
        p = getattr(linear, suffix)
        setattr(linear, suffix, nn.Parameter(spec.wrap(p.detach()), requires_grad=p.requires_grad))
