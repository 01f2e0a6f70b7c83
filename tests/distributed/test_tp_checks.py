"""The tensor-parallel path in this process: a one-rank gloo mesh, MLPs sharded with transformers' styles.

A mesh of one rank runs every step of the TP path (DTensor parameters, transformers' colwise and
rowwise forwards, the fused module's hooks, DTensor state dicts, unpatch) without launching
processes, and lets each way of sharding that the fused MLP cannot run be built and refused.
Several ranks: test_tp_torchrun.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import rel_err, tiny_model
from torch import nn

from swiglu_patch import FusedGatedMLP, PatchError, apply_fused_mlp, unpatch

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES


@pytest.fixture(scope="module")
def mesh():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no torch.distributed with the gloo backend")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process; these tests make their own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _shard(linear: nn.Linear, mesh, placement, bias_placement, style: str | None) -> None:
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [placement]))
    if linear.bias is not None:
        linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [bias_placement]))
    if style is not None:
        ALL_PARALLEL_STYLES[style].install_forward(linear, mesh)


def sharded_llama(mesh, gate_style="colwise", down_style="rowwise", gate_placement=None, plain_down=False):
    """A tiny Llama (MLP biases) whose MLPs are sharded as transformers' tp_plan would, with overrides."""
    model = tiny_model("llama", mlp_bias=True)
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj"):
            _shard(getattr(layer.mlp, name), mesh, gate_placement or Shard(0), Shard(0), gate_style)
        if not plain_down:
            _shard(layer.mlp.down_proj, mesh, Shard(1), Replicate(), down_style)
    return model


def _local_state(model) -> dict:
    return {k: (v.to_local().clone() if isinstance(v, DTensor) else v.clone(),
                tuple(v.placements) if isinstance(v, DTensor) else None) for k, v in model.state_dict().items()}


def test_one_rank_tp_model_patches_runs_saves_and_unpatches(mesh):
    model = sharded_llama(mesh)
    ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
    state = _local_state(model)
    report = apply_fused_mlp(model)
    assert report.patched == ["model.layers.0.mlp", "model.layers.1.mlp"]
    fused = model.model.layers[0].mlp
    assert isinstance(fused, FusedGatedMLP) and type(fused.gate_up_interleaved.data) is torch.Tensor
    assert isinstance(fused.down_proj.weight, DTensor)
    with torch.no_grad():
        after = model(ids).logits
    assert rel_err(after, before) < 1e-6

    patched_state = _local_state(model)
    assert sorted(patched_state) == sorted(state)
    for key, (tensor, placements) in state.items():
        assert placements == patched_state[key][1] and torch.equal(tensor, patched_state[key][0]), key

    saved = model.state_dict()  # gate/up as DTensors unpacked into new tensors
    with torch.no_grad():
        fused.gate_up_interleaved.zero_()
    model.load_state_dict(saved)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, after)

    assert unpatch(model) == 2
    for key, (tensor, placements) in _local_state(model).items():
        assert placements == state[key][1] and torch.equal(tensor, state[key][0]), key
    assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if ".mlp." in n)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_load_state_dict_takes_full_gate_up_tensors_and_refuses_other_shapes(mesh):
    model = sharded_llama(mesh)
    apply_fused_mlp(model)
    fused = model.model.layers[1].mlp
    packed = fused.gate_up_interleaved.detach().clone()
    full = {k: v.full_tensor() if k.startswith(("gate_proj", "up_proj")) else v for k, v in fused.state_dict().items()}
    with torch.no_grad():
        fused.gate_up_interleaved.zero_()
    fused.load_state_dict(full)  # down_proj's entries stay DTensors: torch cannot copy a plain tensor into one
    assert torch.equal(fused.gate_up_interleaved, packed)
    full["gate_proj.weight"] = full["gate_proj.weight"][:-1]
    with pytest.raises(RuntimeError, match=r"gate_proj.weight \(tensor-parallel, tp=1\): expected the full tensor"):
        fused.load_state_dict(full)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(gate_placement="replicate"),
         r"gate_proj.weight is placed \(Replicate\(\),\); the fused MLP needs Shard\(0\)"),
        (dict(down_style="rowwise_split_input"),
         r"down_proj's tensor-parallel style is RowwiseParallel\(input_layouts=Replicate"),
        (dict(gate_style="colwise_gather_output"),
         r"gate_proj's tensor-parallel style is ColwiseParallel\(.*output_layouts=Replicate"),
        (dict(gate_style=None), r"gate_proj's tensor-parallel style is unknown"),
        (dict(plain_down=True), r"are DTensors but down_proj.weight, down_proj.bias are plain tensors"),
    ],
    ids=["gate-replicated", "down-split-input", "gate-gathered-output", "gate-no-style", "down-plain"],
)
def test_sharding_the_fused_mlp_cannot_run_is_refused(mesh, kwargs, expected):
    if kwargs.get("gate_placement") == "replicate":
        kwargs["gate_placement"] = Replicate()
    model = sharded_llama(mesh, **kwargs)
    with pytest.raises(PatchError, match=expected):
        apply_fused_mlp(model)
    report = apply_fused_mlp(model, strict=False)
    assert report.patched == [] and len(report.not_patched) == 2


def test_a_sharded_chunked_gate_up_is_refused(mesh):
    model = tiny_model("phi3")
    for layer in model.model.layers:
        _shard(layer.mlp.gate_up_proj, mesh, Shard(0), Shard(0), "colwise_gather_output")
        _shard(layer.mlp.down_proj, mesh, Shard(1), Replicate(), "rowwise_split_input")
    with pytest.raises(PatchError, match=r"gate_up_proj is a tensor-parallel chunked \[gate; up\] weight"):
        apply_fused_mlp(model)


def test_an_mlp_module_with_its_own_style_is_refused(mesh):
    model = sharded_llama(mesh)
    ALL_PARALLEL_STYLES["all_reduce"].install_forward(model.model.layers[0].mlp, mesh)
    with pytest.raises(PatchError, match="the MLP module itself carries a tensor-parallel style"):
        apply_fused_mlp(model)
