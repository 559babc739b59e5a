"""validate_call: everything fully_shard checks, before it changes anything.

It returns a `ValidatedCall` (what to shard, where, how) or raises an error that names
the module or parameter and the fix; fully_shard then applies the plan in one step, so
a rejected call leaves the module exactly as it was.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .param_checks import check_device, check_param
from .runtime.extension import has_all_gather_extension
from .runtime.mesh import (
    MeshInfo,
    default_mesh,
    mesh_info_for,
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
class ValidatedCall:
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


def validate_call(
    module: Any,
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    dp_mesh_dims: DataParallelMeshDims | None,
) -> ValidatedCall:
    """Validate a fully_shard call (same arguments) and plan it."""
    modules = _validate_modules(module)
    _validate_policies(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy)
    mesh_info = _mesh_info(mesh, dp_mesh_dims)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        # Checked against the call's mesh whatever meshes the groups are on, as torch.
        validate_post_forward_size(mesh_info, reshard_after_forward)
    device = mesh_info.device
    # The one pass over the parameters: each is checked as it is found, and what the
    # group-wide checks need is summarized on the way.
    params, summary = _collect_params(
        modules, set(ignored_params or ()), mesh_info, shard_placement_fn, mp_policy
    )
    summary.validate(modules, reshard_after_forward)
    groups = [
        GroupSharding(
            group_mesh_info,
            group_params,
            post_forward_size=(
                reshard_after_forward  # type: ignore[arg-type]
                if _is_hpz(reshard_after_forward, group_mesh_info)
                else None
            ),
        )
        for group_mesh_info, group_params in _group_by_mesh(params, _post_order(modules))
    ]
    return ValidatedCall(
        modules=modules,
        mesh_info=mesh_info,
        groups=groups,
        moved_buffers=_moved_buffers(modules, device),
        param_device=torch.device("meta") if summary.on_meta == {True} else device,
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
        key = _group_key(mesh_info)
        by_key.setdefault(key, (mesh_info, []))[1].append(source)
        first[key] = min(first.get(key, torch_position(source)), torch_position(source))
    return [by_key[key] for key in sorted(by_key, key=first.__getitem__)]


def _group_key(mesh_info: MeshInfo) -> tuple[object, object]:
    """What tells one call's groups apart: their (shard, replicate) process groups."""
    return (mesh_info.shard_group, mesh_info.replicate_group if mesh_info.is_hsdp else None)


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


@dataclass
class _ParamSummary:
    """What the checks over a whole group need, gathered while `_collect_params` checks
    each parameter: nothing walks the parameters again."""

    on_meta: set[bool] = field(default_factory=set)
    # Per group (`_group_key`): reduce dtype -> a trainable param's FQN with it.
    reduce_dtypes: dict[tuple[object, object], dict[torch.dtype, str]] = field(default_factory=dict)
    # Per group: the FQNs of params with an all-gather extension, and the group's mesh.
    extended: dict[tuple[object, object], list[str]] = field(default_factory=dict)
    mesh_infos: dict[tuple[object, object], MeshInfo] = field(default_factory=dict)

    def add(
        self, source: ParamToShard, mesh_info: MeshInfo, mp_policy: MixedPrecisionPolicy
    ) -> None:
        key = _group_key(mesh_info)
        self.mesh_infos.setdefault(key, mesh_info)
        self.on_meta.add(source.data.device.type == "meta")
        if source.original.requires_grad:
            reduce_dtype = mp_dtypes(mp_policy, source.data.dtype)[1]
            self.reduce_dtypes.setdefault(key, {}).setdefault(reduce_dtype, source.fqn)
        if has_all_gather_extension(source.data):
            self.extended.setdefault(key, []).append(source.fqn)

    def validate(
        self, modules: tuple[nn.Module, ...], reshard_after_forward: bool | int | None
    ) -> None:
        if len(self.on_meta) > 1:
            raise ValueError(
                "fully_shard: some parameters of this group are on the meta device and some "
                "are not; initialize them all on meta (then to_empty after fully_shard) or none"
            )
        for dtypes in self.reduce_dtypes.values():
            # One reduce-scatter per group needs one gradient dtype.
            if len(dtypes) > 1:
                named = ", ".join(f"'{fqn}' ({dtype})" for dtype, fqn in dtypes.items())
                raise NotImplementedError(
                    f"fully_shard: trainable parameters of one group have different dtypes: "
                    f"{named}. Shard them in separate fully_shard calls, cast the module to "
                    "one dtype, or set MixedPrecisionPolicy(reduce_dtype=...)"
                )
        for key, extended in self.extended.items():
            if _is_hpz(reshard_after_forward, self.mesh_infos[key]):
                # torch's FSDP2 accepts the call and raises NotImplementedError at the
                # first backward all-gather; ours says so before anything is sharded.
                raise NotImplementedError(
                    f"fully_shard({type(modules[0]).__name__}, reshard_after_forward="
                    f"{reshard_after_forward}): resharding to a smaller mesh after forward "
                    "is not supported for parameters with all-gather extensions "
                    f"(fsdp_pre_all_gather): {extended}. Use reshard_after_forward=True "
                    "or False for this module"
                )


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
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, name)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(
                f"MixedPrecisionPolicy.{name} must be a floating-point dtype, got {dtype}"
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
    mp_policy: MixedPrecisionPolicy,
) -> tuple[list[tuple[ParamToShard, MeshInfo]], _ParamSummary]:
    """Each parameter this call manages, once, checked, with every slot it is
    registered in and the data-parallel mesh it is sharded on; and the summary the
    group-wide checks need."""
    found: dict[int, tuple[ParamToShard, MeshInfo]] = {}
    summary = _ParamSummary()
    for root in modules:
        root_name = type(root).__name__
        for prefix, module in _walk(root):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                if id(param) not in found:
                    source, param_mesh_info = check_param(
                        root_name, f"{prefix}{name}", param, mesh_info, shard_placement_fn
                    )
                    check_device(f"parameter '{source.fqn}'", source.data, mesh_info.device)
                    summary.add(source, param_mesh_info, mp_policy)
                    found[id(param)] = (source, param_mesh_info)
                found[id(param)][0].slots.append(ParamSlot(module, name, root, f"{prefix}{name}"))
    return list(found.values()), summary


def _moved_buffers(
    modules: tuple[nn.Module, ...], device: torch.device
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    moved = []
    for root in modules:
        for prefix, module in _walk(root):
            for name, buffer in module._buffers.items():
                if buffer is None or buffer.device.type == "meta" or buffer.device == device:
                    continue
                check_device(f"buffer '{prefix}{name}'", buffer, device)
                moved.append((module, name, buffer.to(device)))
    return moved
