"""One parameter's checks for fully_shard, before anything changes: sharing with
another group, shape and contiguity, its placement and mesh (``shard_placement_fn``,
SPMD layouts), its device. `check_param` returns what the group will shard
(validation.py gathers the parameters and runs the call-wide checks)."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .api import DataParallelMeshDims
from .runtime.extension import has_all_gather_extension
from .runtime.mesh import MeshInfo, same_process_groups, spmd_layout, spmd_mesh_info
from .runtime.param import ParamToShard


def mark_replaced(source: ParamToShard, group_name: str) -> None:
    """Leave the tombstone (see `_REPLACED_ATTR`) on an original the group replaced."""
    setattr(source.original, _REPLACED_ATTR, f"{source.fqn} of {group_name}")


# A tombstone on each original parameter a group replaced. A module outside the group
# that still holds the original (a tie across groups: embedding and head in different
# groups) would otherwise get a second, separately sharded copy of it, silently training
# two weights. Only the retired original carries it; FSDP's own state lives on FSDPParam.
_REPLACED_ATTR = "_dtensor_fsdp_sharded_as"


def check_param(
    root_name: str,
    fqn: str,
    param: nn.Parameter,
    mesh_info: MeshInfo,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
) -> tuple[ParamToShard, MeshInfo]:
    sharded_as = getattr(param, _REPLACED_ATTR, None)
    if sharded_as is not None:
        raise ValueError(
            f"fully_shard({root_name}): parameter '{fqn}' is shared with a parameter already "
            f"managed by another FSDP group (an earlier fully_shard call sharded it as "
            f"'{sharded_as}'). For shared/tied parameters, use fully_shard([module_a, "
            "module_b]) to place them in the same FSDP group, or call fully_shard on the "
            "modules' common ancestor only"
        )
    data = param.to_local() if isinstance(param, DTensor) else param
    if data.dim() == 0:
        raise ValueError(
            f"fully_shard({root_name}): fully_shard doesn't support scalar parameters. "
            f"Change {fqn} to a 1D tensor with numel equal to 1. (Parameter '{fqn}' is "
            "0-dimensional and cannot be sharded; or pass it in ignored_params to leave "
            "it unsharded)"
        )
    if not (param.is_contiguous() and data.is_contiguous()):
        raise NotImplementedError(
            f"fully_shard({root_name}): FSDP does not support non-contiguous parameters yet: "
            f"parameter '{fqn}' has shape {tuple(param.shape)} and stride {param.stride()}. "
            "Make it contiguous before fully_shard, e.g. "
            "module.weight = nn.Parameter(module.weight.contiguous())"
        )
    try:
        has_all_gather_extension(data)
    except AssertionError as error:
        raise AssertionError(f"fully_shard({root_name}): parameter '{fqn}': {error}") from None
    where = f"fully_shard({root_name}): parameter '{fqn}'"
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    placement, mesh_info = _placement_and_mesh(where, result, mesh_info)
    shard_dim = _shard_dim(where, data, mesh_info, placement)
    try:
        layout = spmd_layout(mesh_info, param, fqn, shard_dim)
    except ValueError as error:
        # The same type: MeshMismatchError is also the RuntimeError torch raises.
        raise type(error)(f"fully_shard({root_name}): {error}") from None
    return ParamToShard(fqn, param, [], layout, shard_dim), mesh_info


class ShardDimError(ValueError, AssertionError):
    """``shard_placement_fn`` chose a dim the parameter does not have. A ValueError (a
    user mistake), and an AssertionError because torch's fully_shard raises that."""


def _shard_dim(where: str, data: torch.Tensor, mesh_info: MeshInfo, placement: Shard | None) -> int:
    """The dim of ``placement`` (0 for None) on ``data``, validated."""
    if placement is None:
        return 0
    dim = placement.dim + data.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < data.dim():
        raise ShardDimError(
            f"{where}: Shard dim {placement.dim} is invalid for {data.dim()}D tensor "
            f"{tuple(data.shape)}: shard_placement_fn must return Shard(dim) with "
            f"-{data.dim()} <= dim < {data.dim()}, or None"
        )
    size, world_size = data.shape[dim], mesh_info.shard_size
    if dim != 0 and size % world_size != 0:
        raise NotImplementedError(
            f"{where}: FSDP does not support uneven sharding on dim {dim}: size {size} on "
            f"dim {dim}, which the shard world size {world_size} does not divide; "
            "Shard(dim != 0) needs an even split. Return None from shard_placement_fn for "
            "it (Shard(0), padded if uneven)"
        )
    return dim


def _placement_and_mesh(
    where: str, result: Any, mesh_info: MeshInfo
) -> tuple[Shard | None, MeshInfo]:
    """The ``Shard`` (or None) and the data-parallel mesh of a ``shard_placement_fn``
    result: a ``Shard`` or None on ``mesh_info`` (the call's mesh), or torch's
    ``ShardPlacementResult`` (duck-typed: ``placement`` and ``mesh_info``, an
    ``FSDPMeshInfo`` read by its fields) on any data-parallel mesh of the same device
    type; see [Note: several groups of one call]."""
    if hasattr(result, "placement") and hasattr(result, "mesh_info"):
        theirs = result.mesh_info
        their_mesh = getattr(theirs, "mesh", None)
        shard_axis = getattr(theirs, "shard_mesh_dim", None)
        replicate_axis = getattr(theirs, "replicate_mesh_dim", None)
        same = same_process_groups(mesh_info, their_mesh, shard_axis, replicate_axis)
        if same is None:
            raise ValueError(
                f"{where}: Invalid shard_placement_fn result: {result!r}; its mesh_info "
                "needs a DeviceMesh `mesh` and an int `shard_mesh_dim` (an FSDPMeshInfo)"
            )
        if not same:
            assert isinstance(their_mesh, DeviceMesh)
            if their_mesh.device_type != mesh_info.mesh.device_type:
                raise ValueError(
                    f"{where}: shard_placement_fn puts it on {their_mesh}, whose device type "
                    f"is not that of the mesh passed to fully_shard ({mesh_info.mesh}); one "
                    "fully_shard call runs on one device type: build both meshes for it"
                )
            mesh_info = _their_mesh_info(theirs, their_mesh, shard_axis, replicate_axis)
        result = result.placement
    if result is None or type(result) is Shard:
        return result, mesh_info
    raise ValueError(
        f"{where}: Invalid shard_placement_fn result: {result!r}. Return a Shard(dim), None "
        "(Shard(0)) or a ShardPlacementResult"
    )


def _their_mesh_info(
    theirs: Any, mesh: DeviceMesh, shard_axis: int, replicate_axis: int | None
) -> MeshInfo:
    """Our MeshInfo for torch's mesh info: its mesh and axes, or, built from a full SPMD
    mesh with ``dp_mesh_dims`` (torch's ``_get_mesh_info(mesh, dims)``), that mesh's."""
    spmd_mesh, dims = getattr(theirs, "spmd_mesh", None), getattr(theirs, "dp_mesh_dims", None)
    if isinstance(spmd_mesh, DeviceMesh) and dims is not None:
        return spmd_mesh_info(
            spmd_mesh,
            DataParallelMeshDims(
                shard=getattr(dims, "shard", None), replicate=getattr(dims, "replicate", None)
            ),
        )
    return MeshInfo(mesh=mesh, shard_axis=shard_axis, replicate_axis=replicate_axis)


def check_device(what: str, tensor: torch.Tensor, device: torch.device) -> None:
    # CPU tensors are moved to an accelerator mesh's device, as torch's fully_shard does;
    # meta tensors stay on meta. Anything else on another device is a mistake.
    if tensor.device.type in ("meta", device.type) and (
        tensor.device.index is None or device.index is None or tensor.device == device
    ):
        return
    if tensor.device.type == "cpu":
        return
    raise ValueError(
        f"fully_shard: {what} is on {tensor.device}, but the mesh's device is {device}. "
        f"Move the module to {device} before fully_shard (module.to({str(device)!r})), or "
        f"build the mesh for device type {tensor.device.type!r}"
    )
