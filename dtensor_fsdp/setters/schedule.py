"""FSDPModule's settings of when a tree reshards, prefetches and syncs its gradients
(torch's names and semantics); bound as methods by fsdp_module.py."""

from typing import Any

import torch
import torch.nn as nn

from ..runtime.state import FSDPState, max_in_flight_reduce_scatters, state_of
from .groups import fsdp_state, fsdp_states, own_groups, tree_groups, warn_if_graph_mode


def set_is_last_backward(self, is_last_backward: bool) -> None:
    """Whether the next backward is the last before the optimizer step. Accepted as
    torch's is; it changes nothing here: every sharded grad has landed when any
    backward returns (on an accelerator that is a stream wait, which does not block
    the host, so there is nothing to skip), and CPU-offloaded grads are on the host,
    as torch makes them whatever this says."""
    del is_last_backward
    fsdp_state(self)  # the same error as torch's on a module without state


def set_requires_gradient_sync(
    self, requires_gradient_sync: bool, *, recurse: bool = True
) -> None:
    """Whether backward reduce-scatters gradients. ``False`` accumulates unsharded
    gradients locally (gradient accumulation without communication)."""
    for group in tree_groups(self, recurse):
        group.requires_gradient_sync = requires_gradient_sync


def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """HSDP: whether backward all-reduces gradients over the replicate axis. ``False``
    still reduce-scatters within the shard axis and keeps the partial result, which
    the next backward with all-reduce adds in (gradient accumulation across nodes
    at intra-node cost). No effect on a 1-D mesh. Read at every forward in graph
    mode (dtensor_fsdp/graph), as ``set_requires_gradient_sync``."""
    for group in tree_groups(self, recurse):
        group.reduction.update(requires_all_reduce=requires_all_reduce)


def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
    """Whether to free the unsharded parameters after forward (to the full mesh:
    it replaces an int ``reshard_after_forward``, as torch's). Set before the first
    forward, it holds for the root too, which otherwise keeps its parameters."""
    warn_if_graph_mode(self, "set_reshard_after_forward")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    for state in fsdp_states(self, recurse):
        state.auto_reshard_after_forward = False
        for group in state.groups:
            group.reshard_after_forward = reshard_after_forward
            group.post_forward_mesh_info = None


def set_reshard_after_backward(
    self, reshard_after_backward: bool, *, recurse: bool = True
) -> None:
    """Whether to free the unsharded parameters after backward. ``False`` keeps them
    for the next forward (gradient accumulation without re-all-gathering)."""
    for group in tree_groups(self, recurse):
        group.reshard_after_backward = reshard_after_backward


def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
    """All-gather these modules' parameters right after this module's, in forward."""
    fsdp_state(self).forward_prefetch = [_state_for_prefetch(m) for m in modules]


def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
    """All-gather these modules' parameters right after this module's, in backward,
    instead of the default (the module that ran before this one in forward). An
    empty list restores the default, as in torch."""
    states = [_state_for_prefetch(m) for m in modules]
    fsdp_state(self).backward_prefetch = states or None


def set_reduce_scatter_max_input_buffers(
    self, max_input_buffers: int, *, recurse: bool = True
) -> None:
    """Sets how many gradient reduce-scatter input buffers may be in flight at once.

    Each group's reduce-scatter input (its gradients, copied into one buffer) lives
    until the reduce-scatter is waited. With ``k`` buffers, the oldest in flight is
    waited before the next group allocates its own, so at most ``k`` exist at once
    and a group's reduce-scatter may overlap the backward of the next ``k`` groups.
    The default, ``1`` as in torch's FSDP2, overlaps each reduce-scatter with the
    next group's backward; a larger value helps only when one reduce-scatter
    outlasts the next group's whole backward, at the cost of one more group gradient
    buffer per step of ``k`` (see benchmarks/README.md, ``bench_inflight.py``).

    The whole root's tree uses the largest value set on any of its modules, as in
    torch. Unlike torch, which reads it once at the first forward, a later call
    also takes effect (from the next reduce-scatter).

    Args:
        max_input_buffers (int): reduce-scatter input buffers in flight, ``>= 1``.
        recurse (bool): Whether to set for all FSDP submodules or just this one.

    Raises:
        TypeError: ``max_input_buffers`` is not an int (a bool included).
        ValueError: ``max_input_buffers`` is below 1.
    """
    # bool is an int subclass: True must not silently mean 1.
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise TypeError(
            f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}: "
            "pass the number of reduce-scatters in flight, e.g. 1 (the default)"
        )
    if max_input_buffers < 1:
        raise ValueError(
            f"max_input_buffers must be a positive int, got {max_input_buffers}: use 1 "
            "(the default: wait for each reduce-scatter before the next is issued) or more"
        )
    for state in fsdp_states(self, recurse):
        state.max_in_flight_reduce_scatters = max_input_buffers
        root = state.root
        if root is not None and root.ctx is not None:
            root.ctx.max_in_flight_reduce_scatters = max_in_flight_reduce_scatters(
                root.states_in_tree
            )


def set_post_optim_event(self, event: torch.Event) -> None:
    """Give the root an event marking the end of the optimizer step, to wait on
    before its next forward's all-gathers; used once, then discarded.

    dtensor_fsdp issues all-gathers from the current stream, which already runs
    after the optimizer step, so waiting on the event adds no ordering; it is
    accepted so code written for torch's FSDP2 runs unchanged.
    """
    fsdp_state(self).post_optim_event = event


def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
    """Whether backward needs this group's parameters. ``False`` skips the backward
    all-gather (an expert setting, e.g. an embedding). Not recursive."""
    for group in own_groups(self):
        group.unshard_in_backward = unshard_in_backward


def _state_for_prefetch(module: Any) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"prefetch targets must be modules passed to fully_shard, got {type(module).__name__}"
        )
    return state
