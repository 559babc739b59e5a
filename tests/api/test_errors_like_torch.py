"""The same misuse of fully_shard raises the same exception as torch's, with torch's key
phrase, and leaves the module untouched."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from dtensor_fsdp import (
    fully_shard,
)
from tests._harness import fake_mesh
from tests._rejected import _mlp, _snapshot

# Same misuse, same exception as torch's fully_shard #
#
# Each case builds a model and fully_shard's kwargs on a fake group, runs torch's
# fully_shard and ours on separate copies, and checks that ours raises torch's type (or
# a subclass) with torch's key phrase in the message, and leaves the module untouched.
# The phrase is asserted in torch's message too, so a torch that words it differently
# shows up here rather than as a silently weaker test.

Case = Callable[[DeviceMesh], tuple[Callable[[], nn.Module], dict[str, Any]]]


def _scalar_parameter(mesh: DeviceMesh):
    def build() -> nn.Module:
        model = _mlp()
        model.temperature = nn.Parameter(torch.tensor(1.0))
        return model

    return build, {"mesh": mesh}


def _non_contiguous_parameter(mesh: DeviceMesh):
    def build() -> nn.Module:
        model = _mlp()
        model[0].weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4), strides (1, 6)
        return model

    return build, {"mesh": mesh}


def _three_dimensional_mesh(mesh: DeviceMesh):
    return _mlp, {"mesh": DeviceMesh("cpu", torch.arange(8).view(2, 2, 2))}


def _two_dimensional_mesh_without_names(mesh: DeviceMesh):
    return _mlp, {"mesh": DeviceMesh("cpu", torch.arange(4).view(2, 2))}


def _placement_fn(result: Callable[[nn.Parameter], Any], build=_mlp) -> Case:
    return lambda mesh: (build, {"mesh": mesh, "shard_placement_fn": result})


def _tp_mesh_overlapping_the_dp_mesh(mesh: DeviceMesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    # Transposed: its "tp" groups are ranks {0, 2} and {1, 3}, which is dp_mesh's axis.
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["tp"]

    def build() -> nn.Module:
        return parallelize_module(_mlp(), tp_mesh, {"0": ColwiseParallel()})

    return build, {"mesh": dp_mesh}


MISUSES: dict[str, tuple[int, Case, type, str]] = {
    # name: (world size, case, torch's exception type, torch's key phrase)
    # torch names the parameter as registered on its module; here that is its FQN too.
    "scalar_parameter": (
        2, _scalar_parameter, ValueError,
        "fully_shard doesn't support scalar parameters. Change temperature to a 1D tensor "
        "with numel equal to 1.",
    ),
    "non_contiguous_parameter": (
        2, _non_contiguous_parameter, NotImplementedError,
        "FSDP does not support non-contiguous parameters yet",
    ),
    "three_dimensional_mesh": (
        8, _three_dimensional_mesh, ValueError,
        "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
    ),
    "two_dimensional_mesh_without_names": (
        4, _two_dimensional_mesh_without_names, AssertionError,
        "Please init the 2D mesh for HSDP with mesh_dim_names specified",
    ),
    "placement_fn_returns_replicate": (
        2, _placement_fn(lambda p: Replicate()), ValueError, "Invalid shard_placement_fn result"
    ),
    "placement_fn_returns_an_int": (
        2, _placement_fn(lambda p: 1), ValueError, "Invalid shard_placement_fn result"
    ),
    "placement_fn_dim_out_of_range": (
        2, _placement_fn(lambda p: Shard(2)), AssertionError, "Shard dim 2 is invalid for 2D tensor"
    ),
    # torch normalizes -3 to -1 and fails later, in DTensorSpec ("Shard dim -1 in
    # placements ... must be normalized"); what both messages share is "Shard dim".
    "placement_fn_negative_dim_out_of_range": (
        2, _placement_fn(lambda p: Shard(-3)), AssertionError, "Shard dim"
    ),
    "placement_fn_uneven_dim_1": (
        2,
        _placement_fn(lambda p: Shard(1) if p.dim() == 2 else None, lambda: nn.Linear(3, 4)),
        NotImplementedError,
        "FSDP does not support uneven sharding on dim 1",
    ),
    "tp_mesh_overlapping_the_dp_mesh": (
        4, _tp_mesh_overlapping_the_dp_mesh, RuntimeError, "Cannot concatenate overlapping meshes"
    ),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_raises_torchs_exception_and_key_phrase(name: str) -> None:
    world_size, case, torch_error, phrase = MISUSES[name]
    with fake_mesh(world_size) as mesh:
        build, kwargs = case(mesh)
        with pytest.raises(Exception) as theirs:
            torch_fully_shard(build(), **kwargs)
        assert type(theirs.value) is torch_error and phrase in str(theirs.value), theirs.value
        model = build()
        before = _snapshot(model)
        with pytest.raises(torch_error) as ours:
            fully_shard(model, **kwargs)
        assert phrase in str(ours.value)
        assert _snapshot(model) == before
