"""Bad input to fully_shard: a clear error naming the parameter and the fix, and the
module untouched."""

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from dtensor_fsdp import (
    DataParallelMeshDims,
    FSDPModule,
    fully_shard,
)
from tests._harness import fake_mesh
from tests._rejected import _assert_rejected, _mlp


@pytest.mark.parametrize("bad", [42, [], [nn.Linear(2, 2), "not a module"]])
def test_non_module_argument(bad: Any) -> None:
    with fake_mesh(2) as mesh, pytest.raises(TypeError, match="nn.Module"):
        fully_shard(bad, mesh=mesh)


def test_fully_shard_twice_on_one_module() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "already applied to this Sequential.*fully_shard\\(\\[module_a, module_b\\]\\)",
        )


def test_submodule_of_an_already_sharded_module() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model[0], mesh=mesh), ValueError,
            "parameter 'weight' is already a DTensor",
        )
        assert not isinstance(model[0], FSDPModule)


def test_parameter_shared_across_groups_names_it_and_the_fix() -> None:
    model = _mlp()
    model[2].weight = nn.Parameter(torch.randn(6, 6))
    model.add_module("tied", nn.Linear(6, 6, bias=False))
    model.tied.weight = model[2].weight
    with fake_mesh(2) as mesh:
        fully_shard(model[2], mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "'tied.weight' is shared with a parameter already managed by another FSDP group.*as 'weight of Linear'.*common ancestor",
        )


def test_parameter_on_another_device_than_the_mesh() -> None:
    model = _mlp()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model[2].weight = nn.Parameter(torch.empty(2, 6, device="cuda"))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "parameter '2.weight' is on cuda:0, but the mesh's device is cpu.*module.to",
        )


def test_meta_and_real_parameters_mixed_in_one_group() -> None:
    model = _mlp()
    model[0].weight = nn.Parameter(torch.empty(6, 4, device="meta"))
    with fake_mesh(2) as mesh:
        _assert_rejected(model, lambda: fully_shard(model, mesh=mesh), ValueError, "meta device")


def test_zero_dim_parameter_points_to_ignored_params() -> None:
    model = _mlp()
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "doesn't support scalar parameters. Change temperature to a 1D tensor with numel "
            "equal to 1.*'temperature' is 0-dimensional.*ignored_params",
        )
        fully_shard(model, mesh=mesh, ignored_params={model.temperature})
        assert type(model.temperature) is nn.Parameter and model.temperature.dim() == 0


def test_trainable_parameters_of_different_dtypes_in_one_group() -> None:
    model = _mlp()
    model[0].bias = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), NotImplementedError,
            "'0.bias' \\(torch.float64\\).*separate fully_shard calls",
        )


@pytest.mark.parametrize("value", [3, 0, -2])
def test_reshard_after_forward_int_must_divide_the_world_size(value: int) -> None:
    model = _mlp()
    with fake_mesh(4) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, reshard_after_forward=value),
            ValueError, f"reshard_after_forward={value} must be a divisor of the shard world size 4",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, reshard_after_forward="yes"),
            TypeError, "must be a bool, an int or None",
        )


def test_mesh_must_be_a_1d_or_2d_device_mesh() -> None:
    model = _mlp()
    with fake_mesh(8):
        _assert_rejected(
            model, lambda: fully_shard(model, mesh="cpu"), TypeError, "DeviceMesh"
        )
        mesh_3d = DeviceMesh("cpu", torch.arange(8).view(2, 2, 2))
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh_3d), ValueError,
            "but got DeviceMesh.*\\(3-D\\).*1-D mesh \\(FSDP\\) or a 2-D "
            "\\(replicate, shard\\) mesh",
        )


def test_prefetch_targets_must_be_fsdp_modules() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="modules passed to fully_shard, got Linear"):
            model.set_modules_to_forward_prefetch([model[2]])


def test_parameter_shared_between_sibling_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        _assert_rejected(  # model[1] cannot see model[0]: they are siblings
            model, lambda: fully_shard(model[1], mesh=mesh), ValueError,
            "parameter 'weight' is shared with a parameter already managed.*'weight of Linear'.*fully_shard\\(\\[module_a",
        )


def test_dp_mesh_dims_needs_dtensor_params_on_the_full_mesh() -> None:
    model = _mlp()
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError, "parameter '0.weight' is a plain tensor; with dp_mesh_dims every parameter must be a DTensor",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")),
            ValueError, "dp_mesh_dims names \\['fsdp'\\], which mesh",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError, "pass the full SPMD mesh",
        )
        _assert_rejected(
            model,
            lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp"))),
            NotImplementedError, "flattening several mesh axes",
        )
