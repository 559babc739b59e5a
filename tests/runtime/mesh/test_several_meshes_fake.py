"""One fully_shard call on several meshes, on the fake process group: shard_placement_fn
returning torch's ShardPlacementResult (layouts against torch's, groups per mesh), and
what torch refuses or checks there."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_fsdp import (
    fully_shard,
)
from tests._harness import fake_mesh
from tests._rejected import _assert_rejected, _mlp

# shard_placement_fn returning torch's ShardPlacementResult #


def _one_mesh_info(mesh: DeviceMesh) -> Any:
    """torch's mesh info for ``mesh``, as its users build it (FSDP or HSDP)."""
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {
        name: (p.device_mesh, tuple(p.placements), tuple(p.to_local().shape))
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_shard_placement_result_on_the_groups_mesh_matches_torch(shape: tuple) -> None:
    with fake_mesh(4):
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = DeviceMesh("cpu", torch.arange(4).view(shape), mesh_dim_names=names)
        info = _one_mesh_info(mesh)  # one object for every parameter, as torch requires

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(1) if param.dim() == 2 else None, info)

        layouts = []
        for impl in (fully_shard, torch_fully_shard):
            model = nn.Linear(8, 6)
            impl(model, mesh=mesh, shard_placement_fn=placement)
            layouts.append(_layout(model))
    assert layouts[0] == layouts[1]
    assert layouts[0]["weight"][1][-1] == Shard(1)


def test_shard_placement_result_on_another_mesh_makes_a_second_group() -> None:
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4))
        expert_mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("ep", "dp"))
        expert_info = FSDPMeshInfo(expert_mesh["dp"], shard_mesh_dim=0)

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(1), expert_info) if param.dim() == 2 else None

        # torch and ours make a second parameter group, on the other mesh, within one
        # call, ordered by their first parameters: the weights' group first.
        theirs, ours = _mlp(), _mlp()
        torch_fully_shard(theirs, mesh=mesh, shard_placement_fn=placement)
        fully_shard(ours, mesh=mesh, shard_placement_fn=placement)
        their_groups = torch_fully_shard.state(theirs)._fsdp_param_groups
        our_groups = ours._get_fsdp_state().groups
        assert [len(g.fsdp_params) for g in our_groups] == [
            len(g.fsdp_params) for g in their_groups
        ] == [2, 2]
        for name, param in ours.named_parameters():
            their = dict(theirs.named_parameters())[name]
            assert (param.device_mesh, param.placements, param.to_local().shape) == (
                their.device_mesh, their.placements, their.to_local().shape,
            ), name
        assert ours[0].weight.device_mesh == expert_mesh["dp"]
        assert ours[0].weight.placements == (Shard(1),)
        assert ours[0].bias.device_mesh == mesh


def test_shard_placement_result_on_the_call_mesh_joins_its_group() -> None:
    # A ShardPlacementResult on the mesh passed to fully_shard, beside parameters that
    # returned None: torch wants the very FSDPMeshInfo object it built and raises
    # (README, differences); ours puts them in one group, as their process groups are.
    with fake_mesh(2) as mesh:
        info = FSDPMeshInfo(mesh, shard_mesh_dim=0)

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(0), info) if param.dim() == 1 else None

        with pytest.raises(ValueError, match="same FSDPMeshInfo object"):
            torch_fully_shard(_mlp(), mesh=mesh, shard_placement_fn=placement)
        model = fully_shard(_mlp(), mesh=mesh, shard_placement_fn=placement)
        assert [len(g.fsdp_params) for g in model._get_fsdp_state().groups] == [4]


def test_shard_placement_result_without_a_usable_mesh_info() -> None:
    model = _mlp()
    bad = ShardPlacementResult(Shard(0), mesh_info=None)
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: bad),
            ValueError, "'0.weight': Invalid shard_placement_fn result.*FSDPMeshInfo",
        )


# One call on several meshes: what torch refuses or checks there #


class _Experts(nn.Module):
    """Experts registered before the dense child: torch orders the groups by the
    post-order of modules, so the dense group comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 8, 8))
        self.dense = nn.Linear(8, 8)


def _two_meshes() -> tuple[DeviceMesh, DeviceMesh, Callable[[nn.Module], Callable[..., Any]]]:
    dp = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("dp",))
    efsdp = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    dp_info, efsdp_info = FSDPMeshInfo(dp, shard_mesh_dim=0), FSDPMeshInfo(efsdp, shard_mesh_dim=0)

    def placement(block: nn.Module) -> Callable[..., Any]:
        return lambda p: ShardPlacementResult(
            Shard(0), efsdp_info if p is block.experts else dp_info
        )

    return dp, efsdp, placement


@pytest.mark.parametrize(
    "setter",
    [
        lambda m: m.set_custom_all_gather(object()),
        lambda m: m.set_custom_reduce_scatter(object()),
        lambda m: m.set_all_reduce_hook(lambda t: None),
    ],
    ids=["set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook"],
)
def test_custom_comms_are_refused_on_a_call_on_several_meshes(setter: Callable[..., Any]) -> None:
    # A custom collective or hook is written for one process group: torch refuses it on
    # a module whose call made groups on several meshes, with this phrase.
    with fake_mesh(4):
        dp, _, placement = _two_meshes()
        for shard in (torch_fully_shard, fully_shard):
            block = _Experts()
            shard(block, mesh=dp, shard_placement_fn=placement(block))
            with pytest.raises(ValueError, match="not supported with multiple param groups"):
                setter(block)


def test_int_reshard_after_forward_is_checked_against_the_call_mesh() -> None:
    # torch checks the post-forward size against the mesh passed to fully_shard, even
    # when no parameter ends up on it; then against each group's mesh.
    with fake_mesh(4):
        dp, efsdp, placement = _two_meshes()
        dp_info = FSDPMeshInfo(dp, shard_mesh_dim=0)
        calls = {
            "no parameters": lambda shard: shard(nn.ReLU(), mesh=dp, reshard_after_forward=3),
            "all on another mesh": lambda shard: shard(
                _Experts(), mesh=efsdp, reshard_after_forward=4,
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), dp_info),
            ),
            "fits one mesh only": lambda shard: shard(
                (b := _Experts()), mesh=dp, reshard_after_forward=4, shard_placement_fn=placement(b)
            ),
        }
        for name, call in calls.items():
            for shard in (torch_fully_shard, fully_shard):
                with pytest.raises(ValueError, match="factor of"):
                    call(shard)
                    pytest.fail(f"{name}: {shard.__module__} accepted it")


def test_group_names_tell_a_calls_groups_apart() -> None:
    # The comm trace and the divergence check name groups: a call's groups on two
    # meshes whose shard axes share a name get distinct names, the root's no blank.
    with fake_mesh(4):
        dp = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("x",))
        other = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("r", "x"))["x"]
        info = FSDPMeshInfo(other, shard_mesh_dim=0)
        block = _Experts()
        fully_shard(block, mesh=dp, shard_placement_fn=lambda p: (
            ShardPlacementResult(Shard(0), info) if p is block.experts else None
        ))
        block.set_comm_trace(None)  # names the groups from this root
        assert [g.fqn for g in block._get_fsdp_state().groups] == ["[x#0]", "[x#1]"]


def test_torchs_data_parallel_mesh_dims_is_accepted() -> None:
    # A user switching the import line keeps torch's DataParallelMeshDims objects.
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        layouts = []
        for shard in (torch_fully_shard, fully_shard):
            model = _mlp()
            for name, param in list(model.named_parameters()):
                module_name, attr = name.rsplit(".", 1)
                model.get_submodule(module_name).register_parameter(
                    attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()] * 2))
                )
            shard(model, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
            layouts.append({n: (p.placements, p.to_local().shape) for n, p in model.named_parameters()})
        assert layouts[0] == layouts[1]
