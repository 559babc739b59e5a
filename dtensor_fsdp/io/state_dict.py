"""State dicts of fully-sharded modules: the hooks on every module that holds FSDP
parameters.

- ``model.state_dict()`` returns the sharded DTensors under the original FQNs, with no
  communication and no FSDP-specific key mangling; a pre-hook reshards the group first
  (the root stays unsharded after a ``no_grad`` forward), so it never returns unsharded
  parameters, as torch's FSDP2. Each value is a zero-copy alias of the shard with a
  storage of its own, which ``dcp.async_save``'s stager can copy (see [Note: state-dict
  values own their storage]). The hooks sit on every module that holds FSDP
  parameters, as torch's, so a plain submodule's state dict (``model.out``) is sharded
  in and out too. With ``CommPrecisionPolicy(error_feedback=True)`` only, the state
  dict of a module passed to ``fully_shard`` also holds the error-feedback residuals
  (see [Note: error-feedback residuals in state dicts] in ``error_feedback.py``).
- ``model.load_state_dict(sd)`` takes sharded DTensors (any placements or mesh: they
  are redistributed) and plain full tensors (each rank keeps its own chunk: no rank
  broadcasts the model). ``FSDPModule.load_state_dict`` checks the keys and every value
  (type, meta device, shape, dtype, DTensor mesh) before it copies anything, so a bad
  state dict leaves the model as it was (torch's raises after copying the rest). Values
  are copied into the sharded storage in place, cast to the parameter's dtype as
  ``nn.Module`` and torch's FSDP2 do: the zero-copy all-gather input stays intact. With
  ``assign=True`` the registered sharded params stay the same objects; into a model
  built on ``meta`` they take the loaded shards, and the group's sharded buffer is
  re-derived from them (``_take_assigned``).

Before a load, `validate_state_dict` (load_checks.py) refuses what the copy would fail
on; the streamed full export is full_export.py.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.reduction.error_feedback import (
    RESIDUALS_ATTR,
    load_residual_state,
    residual_key,
    residual_layout,
    residual_state,
)
from ..runtime.shard_geometry import wrap_local
from ..runtime.state import FSDPState


@dataclass(frozen=True)
class _HeldParam:
    """An FSDP parameter registered on a module: its group, and its name there."""

    group: FSDPParamGroup
    fsdp_param: FSDPParam
    name: str


def register_state_dict_hooks(state: FSDPState) -> None:
    """Hook every module that holds one of ``state``'s parameters so that its state dict
    is sharded in and out: a plain submodule inside a group too (``model.out`` of the
    root's group), not only the modules passed to ``fully_shard``, as torch's FSDP2
    hooks every module with FSDP params (``FSDPParamGroup._register_state_dict_hooks``
    and ``FSDPParam``'s post-load hook)."""
    held: dict[int, tuple[nn.Module, list[_HeldParam]]] = {}  # by module id
    for group in state.groups:
        for fsdp_param in group.fsdp_params:
            for slot in fsdp_param.slots:
                _, params = held.setdefault(id(slot.module), (slot.module, []))
                params.append(_HeldParam(group, fsdp_param, slot.name))
    for module, params in held.values():
        groups = list({id(p.group): p.group for p in params}.values())
        module.register_state_dict_pre_hook(_reshard_before_state_dict(groups))
        module.register_state_dict_post_hook(_own_storage_values(params))
        module.register_load_state_dict_pre_hook(_shard_loaded_values(groups, params))
        module.register_load_state_dict_post_hook(_adopt_assigned(params))
    # The residuals are keyed under the module passed to fully_shard (see [Note:
    # error-feedback residuals in state dicts]).
    for module in state.modules:
        module.register_state_dict_post_hook(_add_residuals(state))
        module.register_load_state_dict_pre_hook(_take_residuals(state))


def residual_states(state: FSDPState, root: nn.Module) -> dict[str, DTensor]:
    """The error-feedback residuals of ``root``'s params (``root``: one of ``state``'s
    modules) as state-dict values, by their params' keys relative to ``root``; empty
    without error feedback. See [Note: error-feedback residuals in state dicts]."""
    states = {}
    for group in state.groups:
        for fsdp_param in group.reduction.error_feedback_params():
            slot = fsdp_param.slots[0]  # a tied param's residual is saved once
            if slot.root is root:
                residual = group.reduction.error_feedback.residual(fsdp_param)
                states[slot.key] = residual_state(fsdp_param, residual)
    return states


def _add_residuals(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for key, value in residual_states(state, module).items():
            state_dict[residual_key(prefix, key)] = value

    return hook


def _take_residuals(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        _load_residuals(state, module, state_dict, prefix)

    return hook


def _reshard_before_state_dict(groups: list[FSDPParamGroup]) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        for group in groups:
            group.reshard()

    return hook


def _own_storage_values(params: list[_HeldParam]) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for held in params:
            key = prefix + held.name
            value = state_dict.get(key)
            # keep_vars=True hands out the registered Parameter itself: left as it is.
            if isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
                state_dict[key] = _with_own_storage(value)

    return hook


# [Note: state-dict values own their storage]
# A sharded param's local tensor is a view into its group's sharded buffer ([Note:
# sharded buffer]): every param after the first has a nonzero storage offset, and a
# DTensor built on it inherits that offset on its own (data-less) wrapper storage. torch's
# async checkpoint stager (StateDictStager._offload_tensor, used by dcp.async_save) takes
# a tensor with ``data_ptr() != 0`` for one with a storage of its own and copies that
# storage: for such a DTensor the wrapper's invalid one, which raises "Attempted to call
# copy_() on an invalid python storage". torch's FSDP2 never meets it: each of its
# sharded params owns an offset-0 storage. So the state dict hands out each value over
# an alias of its local tensor's bytes with a storage of its own (DLPack: zero-copy, the
# same memory, kept alive by the alias): offset 0, the stager then copies exactly the
# shard, and writes into the value (``dcp.load`` in place) reach the sharded param, as
# torch's. Only the state dict sees the alias; the params stay views of the buffer
# (the all-gather reads it in place). Unlike a view, the alias has its own version
# counter, so `_reshard_if_stale` misses a ``dcp.load`` into it alone; the documented
# route, ``dcp.load`` then ``load_state_dict`` (``set_state_dict``), copies into the
# params (counted) after our pre-hook resharded them.


def _with_own_storage(value: DTensor) -> DTensor:
    """``value`` (a sharded param's state-dict value) over a zero-copy alias of its
    local tensor with a storage of its own, at offset 0. See [Note: state-dict values
    own their storage]."""
    local = value.to_local()
    if type(local) is not torch.Tensor:
        return value  # an all-gather extension's own subclass tensor, not a view
    try:
        alias = torch.from_dlpack(local.detach())  # same shape, stride, memory; offset 0
    except (ValueError, BufferError):
        # A device DLPack does not cover (meta: no bytes; a PrivateUse1 backend): the
        # view itself, which every path but the async stager takes.
        return value
    return wrap_local(alias, value.device_mesh, value.placements, value.shape, value.stride())


def _shard_loaded_values(
    groups: list[FSDPParamGroup], params: list[_HeldParam]
) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for group in groups:
            group.reshard()
        for held in params:
            key = prefix + held.name
            if key in state_dict:
                state_dict[key] = _to_sharded_value(
                    held.fsdp_param, state_dict[key], _load_device(held)
                )

    return hook


def _load_residuals(
    state: FSDPState, root: nn.Module, state_dict: dict[str, Any], prefix: str
) -> None:
    """Take ``root``'s error-feedback residuals out of ``state_dict`` (``nn.Module``
    would call them unexpected) into the residuals. A param loaded without its residual
    restarts it at zero; a residual for a param that keeps none is ignored, with a
    warning. See [Note: error-feedback residuals in state dicts]."""
    for group in state.groups:
        feedback = group.reduction.error_feedback
        for fsdp_param in group.reduction.error_feedback_params():
            slot = fsdp_param.slots[0]
            if slot.root is not root:
                continue
            key = residual_key(prefix, slot.key)
            if key in state_dict:
                mesh, placements = residual_layout(fsdp_param)
                value = _to_placements(
                    state_dict.pop(key), mesh, placements, fsdp_param.compute_device
                )
                load_residual_state(fsdp_param, feedback.residual(fsdp_param), value)
            elif prefix + slot.key in state_dict:
                feedback.reset(fsdp_param)
    ignored = [key for key in state_dict if key.startswith(f"{prefix}{RESIDUALS_ATTR}.")]
    for key in ignored:
        del state_dict[key]
    if ignored:
        warnings.warn(
            f"error-feedback residuals ignored for {ignored}: these params keep none "
            "(error feedback off, filtered out, or one rank per shard group)",
            stacklevel=2,
        )


def _adopt_assigned(params: list[_HeldParam]) -> Callable[..., None]:
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        taken = [p.group for p in params if _take_assigned(p, module)]
        for group in {id(g): g for g in taken}.values():
            # The group's last module loaded: its sharded buffer is re-derived from what
            # the sharded params hold now. A slot still replaced belongs to a module whose
            # post-hook runs later (an ancestor's own params), which re-derives then.
            if not any(p.is_replaced() for p in group.fsdp_params):
                group.reset_sharded_params()

    return hook


def _load_device(held: _HeldParam) -> torch.device:
    """Where a loaded value's shard goes: with the sharded param; for one still on
    ``meta`` (a model built on meta, loaded with ``assign=True``) where the group will
    keep it, the mesh's device (the CPU under CPU offload)."""
    local = held.fsdp_param.registered_local()
    if not local.is_meta:
        return local.device
    return torch.device("cpu") if held.group.offload is not None else held.group.mesh_info.device


def _to_sharded_value(fsdp_param: FSDPParam, value: torch.Tensor, device: torch.device) -> DTensor:
    """A state-dict value for this parameter, in the sharded param's placements.

    A plain tensor is taken as the full parameter and this rank keeps its chunk, on
    ``device``; a DTensor with other placements or another mesh is redistributed. No
    rank sends the whole model to the others.
    """
    layout = fsdp_param.layout
    return _to_placements(value, layout.mesh, layout.placements, device)


def _to_placements(
    value: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    device: torch.device,
) -> DTensor:
    """``value`` (a DTensor, or a plain tensor taken as the full value, moved to
    ``device``) as a DTensor on ``mesh`` with ``placements``."""
    if isinstance(value, DTensor):
        if value.device_mesh == mesh and tuple(value.placements) == placements:
            return value
        value = value.full_tensor() if value.device_mesh != mesh else value
    if not isinstance(value, DTensor):
        # Replicated on ``device`` (the host under CPU offload), so the redistribution
        # below only slices this rank's chunk out of it there: DTensor.from_local
        # would move it to the mesh's device type first.
        local = value.to(device)
        value = wrap_local(local, mesh, [Replicate()] * mesh.ndim, local.shape, local.stride())
    return value.redistribute(mesh, placements)


def _take_assigned(held: _HeldParam, module: nn.Module) -> bool:
    """After ``load_state_dict(assign=True)`` registered a new Parameter in this slot,
    make its values the sharded param's, which stays the registered object (README,
    differences) in every slot. Returns whether there was one.

    Materialized, the values are copied into the sharded param's local tensor in place,
    cast to its dtype. On ``meta`` there is nothing to copy into: the sharded param
    takes the assigned local tensor, moved to where the group keeps it (the host under
    CPU offload, as torch's pinned offload moves it: a DTensor on the device mesh holds
    its shard on the device), by ``swap_tensors``, as ``nn.Module._apply`` swaps a
    DTensor param for ``to_empty``; the group re-derives its sharded buffer from it,
    as after ``to_empty`` ([Note: re-deriving the sharded state] in group_layout.py).
    """
    fsdp_param = held.fsdp_param
    assigned = module._parameters.get(held.name)
    param = fsdp_param.sharded_param
    if assigned is param or assigned is None:
        return False
    assert isinstance(assigned, DTensor), f"{fsdp_param.fqn}: the load pre-hook shards it"
    with torch.no_grad():
        local = assigned.to_local().to(_load_device(held), fsdp_param.dtype)  # (*local_shape)
        if fsdp_param.registered_local().is_meta:
            adopted = nn.Parameter(fsdp_param._sharded_dtensor(local), param.requires_grad)
            torch.utils.swap_tensors(param, adopted)
        else:
            fsdp_param.registered_local().copy_(local)
    fsdp_param._register(param)
    return True
