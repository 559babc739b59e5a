"""The twin state of a local-shard step (see [Note: local-shard step] in
local_shards.py): what the swap records of each param and param group, the checks of a
DTensor param and its state values, and the DTensor state brought up to its local twin
after a step."""

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..runtime.shard_geometry import wrap_local

State = dict[torch.Tensor, dict[str, Any]]


@dataclass
class LocalParam:
    """One DTensor param as the optimizer sees it during ``step``."""

    param: DTensor
    source: torch.Tensor  # param._local_tensor when the alias was made
    alias: torch.Tensor  # source.detach(): same storage, a plain leaf
    dstate: dict[str, Any] | None = None  # optimizer.state[param] at the last sync
    lstate: dict[str, Any] | None = None  # its twin, keyed by alias in the swap's state
    # At the last sync: the state's names, and their values in dstate and in lstate.
    names: tuple[str, ...] = ()
    dvalues: tuple[Any, ...] = ()
    lvalues: tuple[Any, ...] = ()

    def synced(self, dstate: dict[str, Any], lstate: dict[str, Any]) -> None:
        self.dstate, self.lstate = dstate, lstate
        self.names = tuple(lstate)
        self.dvalues = tuple(dstate[name] for name in self.names)
        self.lvalues = tuple(lstate.values())


@dataclass
class GroupSwap:
    params: list[torch.Tensor]  # the group's params list, as the user left it
    members: tuple[torch.Tensor, ...]  # its elements when the swap was built
    aliases: list[torch.Tensor]  # what the optimizer sees during the step


@dataclass
class Swap:
    """Everything the swap needs, reused from step to step (see [Note: local-shard step])."""

    state: State  # optimizer.state (keyed by the DTensor params)
    local_state: State  # its twin, keyed by the aliases
    groups: list[GroupSwap]
    entries: list[LocalParam]  # each DTensor param once
    plain: list[torch.Tensor]  # each plain param once: its state dict is shared
    synced_len: int = 0  # len(local_state) at the last sync


# Validation and state mapping #


def param_name(group: dict[str, Any], index: int, position: int) -> str:
    names = group.get("param_names")
    if names is not None and position < len(names):
        return f"{names[position]!r} (param_groups[{index}])"
    return f"param_groups[{index}]['params'][{position}]"


def check_param(param: DTensor, name: str) -> None:
    """A DTensor param whose update its local tensor alone can carry."""
    what = f"{name}, a DTensor of shape {tuple(param.shape)} with placements {param.placements}"
    if any(placement.is_partial() for placement in param.placements):
        raise ValueError(
            f"step_on_local_shards: {what}: a Partial placement holds a summand of each "
            "element, not the element; redistribute it to Shard/Replicate before the step"
        )
    if param.dim() == 0:
        raise ValueError(
            f"step_on_local_shards: {what}: a 0-dim param's element-wise state cannot be "
            "told apart from scalar state such as 'step'; keep it in another optimizer"
        )


def same_spec(tensor: DTensor, param: DTensor) -> bool:
    spec, param_spec = tensor._spec, param._spec
    return (
        spec.mesh is param_spec.mesh or spec.mesh == param_spec.mesh
    ) and spec.placements == param_spec.placements


def local_value(param: DTensor, name: str, value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    if not same_spec(value, param):
        raise ValueError(
            f"step_on_local_shards: optimizer state {name!r} of a param with placements "
            f"{param.placements} is a DTensor with placements {value.placements} on "
            f"{value.device_mesh}; load the state in the param's placements"
        )
    return value._local_tensor


def unchanged(
    current: dict[str, Any],
    recorded: dict[str, Any] | None,
    names: tuple[str, ...],
    values: tuple[Any, ...],
) -> bool:
    """Whether ``current`` is the ``recorded`` dict, holding ``values`` under ``names``,
    by identity (a changed order counts as a change: the swap is rebuilt)."""
    return (
        current is recorded
        and len(current) == len(names)
        and tuple(current) == names
        and all(map(operator.is_, current.values(), values))
    )


def sync_state(entry: LocalParam, lstate: dict[str, Any]) -> None:
    """Bring the DTensor state dict up to its twin after a step that changed it; the
    same dict object as before the step if there was one (code may hold it)."""
    param = entry.param
    dstate = entry.dstate if entry.dstate is not None else {}
    previous = dict(zip(entry.names, zip(entry.dvalues, entry.lvalues, strict=True), strict=True))
    values = {}
    for name, value in lstate.items():
        pair = previous.get(name)
        if pair is not None and pair[1] is value:
            values[name] = pair[0]  # unchanged, or a DTensor updated in place
        elif _is_new_param_like(value, pair, entry.alias):
            # New state made like the param: torch.optim gets a DTensor for it, whose
            # local tensor is this one (on the host under CPU offload, as torch.optim's
            # ``zeros_like(param)`` is).
            values[name] = wrap_local(
                value, param.device_mesh, param.placements, param.shape, param.stride()
            )
        else:
            values[name] = value
    dstate.clear()
    dstate.update(values)
    entry.synced(dstate, lstate)


def _is_new_param_like(value: Any, pair: tuple[Any, Any] | None, alias: torch.Tensor) -> bool:
    """A plain tensor the step stored in place of a DTensor value (or under a new name)
    with the param's local shape; 0-dim values are scalar state."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and (pair is None or isinstance(pair[0], DTensor))
        and value.dim() > 0
        and value.shape == alias.shape
    )


def append_new_state(swap: Swap) -> None:
    """State entries the step created, appended to ``optimizer.state`` in creation
    order, as the DTensor step appends them."""
    by_alias = {id(entry.alias): entry for entry in swap.entries}
    for key, lstate in list(swap.local_state.items())[swap.synced_len :]:
        entry = by_alias.get(id(key))
        if entry is None:
            swap.state[key] = lstate  # a plain param: the dict is shared
            continue
        if entry.lstate is not lstate:
            sync_state(entry, lstate)
        swap.state[entry.param] = entry.dstate
    swap.synced_len = len(swap.local_state)
