"""plan_sharding: everything fully_shard checks, before it changes anything.

It returns a `ShardingPlan` (what to shard, where, how) or raises an error that names
the module or parameter and the fix; fully_shard then applies the plan in one step, so
a rejected call leaves the module exactly as it was.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .runtime.extension import has_all_gather_extension
from .runtime.mesh import (
    MeshInfo,
    default_mesh,
    mesh_info_for,
    same_process_groups,
    spmd_layout,
    spmd_mesh_info,
    validate_post_forward_size,
)
from .runtime.param import ParamSlot, ParamToShard, mp_dtypes
from .runtime.state import state_of


@dataclass(frozen=True)
class GroupSharding:
    """How one call's parameters on one data-parallel mesh are sharded: what becomes
    one FSDPParamGroup. (Not ``plan.GroupPlan``, the planner's report of a group.)"""

    mesh_info: MeshInfo
    params: list[ParamToShard]
    post_forward_size: int | None  # hpZ: the smaller world size after forward


@dataclass(frozen=True)
class ShardingPlan:
    """A validated fully_shard call."""

    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo  # the mesh passed to fully_shard
    groups: list[GroupSharding]  # see [Note: several groups of one call]
    moved_buffers: list[tuple[nn.Module, str, torch.Tensor]]  # (owner, name, moved copy)
    param_device: torch.device  # where the sharded params go (meta stays meta)
    reshard_after_forward: bool
    # The modules this call manages, as torch's fully_shard picks them; see
    # `_managed_modules`.
    managed_modules: list[nn.Module]


def plan_sharding(
    module: Any,
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    dp_mesh_dims: DataParallelMeshDims | None,
) -> ShardingPlan:
    """Validate a fully_shard call (same arguments) and plan it."""
    modules = _validate_modules(module)
    _validate_policies(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy)
    mesh_info = _mesh_info(mesh, dp_mesh_dims)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        # Checked against the call's mesh whatever meshes the groups are on, as torch.
        validate_post_forward_size(mesh_info, reshard_after_forward)
    device = mesh_info.device
    params = _collect_params(modules, set(ignored_params or ()), mesh_info, shard_placement_fn)
    groups = []
    for group_mesh_info, group_params in _group_by_mesh(params, _post_order(modules)):
        _validate_reduce_dtypes(group_params, mp_policy)
        hpz = _is_hpz(reshard_after_forward, group_mesh_info)
        if hpz:
            _validate_no_extensions_for_hpz(modules, group_params, reshard_after_forward)
        groups.append(
            GroupSharding(
                group_mesh_info,
                group_params,
                post_forward_size=reshard_after_forward if hpz else None,  # type: ignore[arg-type]
            )
        )
    flat = [source for source, _ in params]
    _validate_devices(flat, device)
    return ShardingPlan(
        modules=modules,
        mesh_info=mesh_info,
        groups=groups,
        moved_buffers=_moved_buffers(modules, device),
        param_device=_param_device(flat, device),
        reshard_after_forward=_reshards_after_forward(reshard_after_forward),
        managed_modules=_managed_modules(modules, ignored_params),
    )


# [Note: several groups of one call]
# shard_placement_fn may put parameters on other data-parallel meshes than the one
# passed to fully_shard (torchtitan's MoE blocks: routed experts on the expert mesh,
# the rest on the dense one). As in torch's FSDP2, the call then makes one group per
# distinct (shard process group, replicate process group), ordered by their first
# parameters; each is all-gathered and reduced on its own mesh, and the call's hooks
# drive them together: forward unshards them in order, backward reduces them last to
# first (torch chains one post-backward node per group on the inputs), and only the
# second group prefetches in backward (see CommContext._implicit_backward_targets).
# Unlike torch, which also wants one FSDPMeshInfo object per process-group pair (it
# raises ValueError for two equal ones), ours keys by the process groups alone.


def _group_by_mesh(
    params: list[tuple[ParamToShard, MeshInfo]], post_order: dict[int, int]
) -> list[tuple[MeshInfo, list[ParamToShard]]]:
    """The parameters of each distinct data-parallel mesh (each group's in ``params``
    order), the groups ordered as torch's: by their first parameter in the post-order
    of the managed modules (a module's children before its own parameters)."""

    def torch_position(source: ParamToShard) -> tuple[int, int]:
        return min(
            (post_order[id(slot.module)], list(slot.module._parameters).index(slot.name))
            for slot in source.slots
        )

    by_key: dict[tuple[object, object], tuple[MeshInfo, list[ParamToShard]]] = {}
    first: dict[tuple[object, object], tuple[int, int]] = {}
    for source, mesh_info in params:
        key = (
            mesh_info.shard_group,
            mesh_info.replicate_group if mesh_info.is_hsdp else None,
        )
        by_key.setdefault(key, (mesh_info, []))[1].append(source)
        first[key] = min(first.get(key, torch_position(source)), torch_position(source))
    return [by_key[key] for key in sorted(by_key, key=first.__getitem__)]


def _post_order(modules: tuple[nn.Module, ...]) -> dict[int, int]:
    """Each module of the call's subtrees (not those an earlier call owns), numbered in
    post-order, as torch's fully_shard collects its managed modules."""
    order: dict[int, int] = {}
    done = 0

    def visit(module: nn.Module) -> None:
        nonlocal done
        if id(module) in order:
            return
        order[id(module)] = -1  # visiting: a shared module is numbered once
        for child in module.children():
            if state_of(child) is None:
                visit(child)
        order[id(module)] = done
        done += 1

    for root in modules:
        visit(root)
    return order


def _validate_no_extensions_for_hpz(
    modules: tuple[nn.Module, ...],
    params: list[ParamToShard],
    reshard_after_forward: bool | int | None,
) -> None:
    extended = [p.fqn for p in params if has_all_gather_extension(p.data)]
    if extended:
        # torch's FSDP2 accepts the call and raises NotImplementedError at the first
        # backward all-gather; ours says so before anything is sharded.
        raise NotImplementedError(
            f"fully_shard({type(modules[0]).__name__}, reshard_after_forward="
            f"{reshard_after_forward}): resharding to a "
            "smaller mesh after forward is not supported for parameters with all-gather "
            f"extensions (fsdp_pre_all_gather): {extended}. Use reshard_after_forward=True "
            "or False for this module"
        )


def mark_replaced(source: ParamToShard, group_name: str) -> None:
    """Leave the tombstone (see `_REPLACED_ATTR`) on an original the group replaced."""
    setattr(source.original, _REPLACED_ATTR, f"{source.fqn} of {group_name}")


# A tombstone on each original parameter a group replaced. A module outside the group
# that still holds the original (a tie across groups: embedding and head in different
# groups) would otherwise get a second, separately sharded copy of it, silently training
# two weights. Only the retired original carries it; FSDP's own state lives on FSDPParam.
_REPLACED_ATTR = "_dtensor_fsdp_sharded_as"


def _mesh_info(mesh: DeviceMesh | None, dp_mesh_dims: DataParallelMeshDims | None) -> MeshInfo:
    if dp_mesh_dims is None:
        return mesh_info_for(mesh if mesh is not None else default_mesh())
    if mesh is None:
        raise ValueError("dp_mesh_dims names axes of the mesh argument: pass the full SPMD mesh")
    return spmd_mesh_info(mesh, dp_mesh_dims)


def _reshards_after_forward(reshard_after_forward: bool | int | None) -> bool:
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward is not False
    return reshard_after_forward > 1  # an int: the post-forward world size; 1 keeps all


def _is_hpz(reshard_after_forward: bool | int | None, mesh_info: MeshInfo) -> bool:
    """Whether ``reshard_after_forward`` asks to reshard to a strictly smaller mesh.

    As in torch, an int equal to the shard world size means True, and 1 means False.
    """
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return False
    validate_post_forward_size(mesh_info, reshard_after_forward)
    return 1 < reshard_after_forward < mesh_info.shard_size


def _validate_modules(module: Any) -> tuple[nn.Module, ...]:
    if isinstance(module, nn.Module):
        modules: tuple[Any, ...] = (module,)
    elif isinstance(module, (list, tuple)) and module:
        modules = tuple(module)
    else:
        raise TypeError(
            f"fully_shard expects an nn.Module or a non-empty list of nn.Modules, "
            f"got {type(module).__name__}"
        )
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__} in the list")
        if state_of(m) is not None:
            original_name = type(m).__mro__[2].__name__  # FSDP<cls>, FSDPModule, <cls>
            raise ValueError(
                f"fully_shard was already applied to this {original_name} module; a module "
                "can be passed to fully_shard once. To change its grouping, build the model "
                "again and call fully_shard([module_a, module_b]) for one group of both"
            )
    return modules


def _validate_policies(
    reshard_after_forward: Any,
    shard_placement_fn: Any,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(
                f"MixedPrecisionPolicy.{field} must be a floating-point dtype, got {dtype}"
            )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"
        )


def _walk(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(prefix, module) for ``root``'s subtree, skipping subtrees an earlier
    ``fully_shard`` already owns: their parameters belong to their groups."""
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        yield prefix, module
        children = [
            (f"{prefix}{name}.", child)
            for name, child in module.named_children()
            if state_of(child) is None
        ]
        stack.extend(reversed(children))


def _managed_modules(
    modules: tuple[nn.Module, ...], ignored_params: set[nn.Parameter] | None
) -> list[nn.Module]:
    """The modules torch's ``fully_shard`` marks as managed (``_get_managed_modules``):
    the subtrees of ``modules``, each module once, minus subtrees an earlier
    ``fully_shard`` owns; with ``ignored_params`` (even an empty set, as torch), minus the
    modules it leaves nothing of: no buffer, every parameter ignored, every child such a
    module too (so a parameterless leaf such as ``nn.ReLU`` as well)."""
    managed = list({id(m): m for root in modules for _, m in _walk(root)}.values())
    if ignored_params is None:
        return managed
    ignored: dict[int, bool] = {}

    def is_ignored(module: nn.Module) -> bool:
        if id(module) not in ignored:
            ignored[id(module)] = (
                not any(True for _ in module.buffers(recurse=False))
                and all(p in ignored_params for p in module.parameters(recurse=False))
                and all(is_ignored(child) for child in module.children())
            )
        return ignored[id(module)]

    return [m for m in managed if not is_ignored(m)]


def _collect_params(
    modules: tuple[nn.Module, ...],
    ignored: set[nn.Parameter],
    mesh_info: MeshInfo,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
) -> list[tuple[ParamToShard, MeshInfo]]:
    """Each parameter this call manages, once, with every slot it is registered in,
    and the data-parallel mesh it is sharded on."""
    found: dict[int, tuple[ParamToShard, MeshInfo]] = {}
    for root in modules:
        root_name = type(root).__name__
        for prefix, module in _walk(root):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                if id(param) not in found:
                    found[id(param)] = _param_to_shard(
                        root_name, f"{prefix}{name}", param, mesh_info, shard_placement_fn
                    )
                found[id(param)][0].slots.append(ParamSlot(module, name, root, f"{prefix}{name}"))
    return list(found.values())


def _param_to_shard(
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


def _validate_reduce_dtypes(params: list[ParamToShard], mp_policy: MixedPrecisionPolicy) -> None:
    # One reduce-scatter per group needs one gradient dtype.
    dtypes = {
        mp_dtypes(mp_policy, p.data.dtype)[1]: p.fqn for p in params if p.original.requires_grad
    }
    if len(dtypes) > 1:
        named = ", ".join(f"'{fqn}' ({dtype})" for dtype, fqn in dtypes.items())
        raise NotImplementedError(
            f"fully_shard: trainable parameters of one group have different dtypes: {named}. "
            "Shard them in separate fully_shard calls, cast the module to one dtype, or set "
            "MixedPrecisionPolicy(reduce_dtype=...)"
        )


def _validate_devices(params: list[ParamToShard], device: torch.device) -> None:
    for source in params:
        _check_device(f"parameter '{source.fqn}'", source.data, device)
    kinds = {source.data.device.type == "meta" for source in params}
    if len(kinds) > 1:
        raise ValueError(
            "fully_shard: some parameters of this group are on the meta device and some are "
            "not; initialize them all on meta (then to_empty after fully_shard) or none"
        )


def _check_device(what: str, tensor: torch.Tensor, device: torch.device) -> None:
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


def _moved_buffers(
    modules: tuple[nn.Module, ...], device: torch.device
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    moved = []
    for root in modules:
        for prefix, module in _walk(root):
            for name, buffer in module._buffers.items():
                if buffer is None or buffer.device.type == "meta" or buffer.device == device:
                    continue
                _check_device(f"buffer '{prefix}{name}'", buffer, device)
                moved.append((module, name, buffer.to(device)))
    return moved


def _param_device(params: list[ParamToShard], device: torch.device) -> torch.device:
    if params and params[0].data.device.type == "meta":
        return torch.device("meta")
    return device
