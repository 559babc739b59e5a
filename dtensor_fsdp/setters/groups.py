"""A sharded module's FSDP states and groups, as `FSDPModule` and its setters
(setters/) read them."""

import warnings

import torch.nn as nn

from ..graph.switch import is_graph_mode
from ..runtime.param_group import FSDPParamGroup
from ..runtime.state import FSDPState, state_of


def fsdp_state(module: nn.Module) -> FSDPState:
    """``module``'s own state (its ``fully_shard`` call's)."""
    state = state_of(module)
    assert state is not None, "FSDPModule without FSDP state"
    return state


def fsdp_states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    """``module``'s state, and with ``recurse`` every state under it, each once."""
    if not recurse:
        return [fsdp_state(module)]
    seen: dict[int, FSDPState] = {}
    for submodule in module.modules():
        state = state_of(submodule)
        if state is not None:
            seen.setdefault(id(state), state)
    return list(seen.values())


def own_groups(module: nn.Module) -> list[FSDPParamGroup]:
    return list(fsdp_state(module).groups)


def tree_groups(module: nn.Module, recurse: bool) -> list[FSDPParamGroup]:
    return [g for s in fsdp_states(module, recurse) for g in s.groups]


def single_mesh_groups(module: nn.Module, method: str) -> list[FSDPParamGroup]:
    """``module``'s groups, refused when they are on several meshes: a custom
    collective or hook is written for one process group (torch's check)."""
    groups = own_groups(module)
    if len(groups) > 1:
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param "
            "mesh via shard_placement_fn): the custom comm would be ambiguous across "
            f"groups with different meshes (axes {[g.mesh_info.label for g in groups]})"
        )
    return groups


def warn_if_graph_mode(module: nn.Module, setter: str) -> None:
    """Graph mode reads the settings when it is enabled (dtensor_fsdp/graph)."""
    if is_graph_mode(module):
        warnings.warn(
            f"{type(module).__name__} is in graph mode, which read its settings when it "
            f"was enabled: {setter} takes effect once dtensor_fsdp.compile (or "
            "enable_graph_mode) runs again",
            stacklevel=3,
        )
