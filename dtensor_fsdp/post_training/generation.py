"""`keep_unsharded`: every group of a ``fully_shard`` tree stays gathered across many
forwards (Hugging Face's ``generate()``: one forward per token), and is resharded once
at the end.

Without it, each non-root group is all-gathered at every forward of ``generate()``: a
4-layer Llama with 5 groups makes 129 all-gathers for 32 new tokens, ours and torch's
alike. The root's ``unshard()`` beforehand does not help (it gathers only the root's
group); with torch, ``set_reshard_after_forward(False)`` on the root and a
``reshard()`` of every FSDP module afterwards gives one per group, and leaves
``reshard_after_forward=False`` set for training. This context does that and puts the
settings back.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from ..runtime.mesh import MeshInfo
from ..runtime.param import ShardedState
from ..runtime.param_group import FSDPParamGroup, TrainingState
from ..runtime.state import FSDPState, state_of


@dataclass(frozen=True)
class _Saved:
    """A group's settings and state when the context was entered."""

    group: FSDPParamGroup
    reshard_after_forward: bool
    post_forward_mesh_info: MeshInfo | None  # hpZ
    was_sharded: bool


@contextlib.contextmanager
def keep_unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Keep each group of ``model``'s tree unsharded from its first forward inside the
    context to the end of it: one all-gather per group for a whole ``generate()``.

    On exit (an exception too) the groups sharded on entry are resharded and every
    group's ``reshard_after_forward`` (hpZ's too) is what it was: the model is as it
    was, ready to train. No gradients flow differently: it only keeps what forward
    gathered. Works inside ``torch.no_grad()`` and ``torch.inference_mode()``. Memory:
    the whole model unsharded by the end, as ``generate()`` uses every group.

    Args:
        model: the root of a ``fully_shard`` tree (the module whose forward runs
            first); if no forward ran yet it becomes the root here.

    Yields:
        ``model``.

    Raises:
        ValueError: ``model`` is not a ``fully_shard`` module, or is not its tree's root.
        RuntimeError: a group is inside a forward or backward (a hook called it).
    """
    root = _root_state(model)
    groups = [group for state in root.states_in_tree for group in state.groups]
    busy = [g.fqn or "root" for g in groups if g.training_state != TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"keep_unsharded: groups {busy} are inside a forward or backward; enter it "
            "between iterations (after backward and the optimizer step)"
        )
    saved = [
        _Saved(
            group,
            group.reshard_after_forward,
            group.post_forward_mesh_info,
            group.sharded_state == ShardedState.SHARDED,
        )
        for group in groups
    ]
    for group in groups:
        group.reshard_after_forward = False
        group.post_forward_mesh_info = None
    try:
        yield model
    finally:
        for entry in saved:
            entry.group.reshard_after_forward = entry.reshard_after_forward
            entry.group.post_forward_mesh_info = entry.post_forward_mesh_info
            if entry.was_sharded:
                entry.group.reshard()


def _root_state(model: nn.Module) -> FSDPState:
    """``model``'s FSDP state, made the root of its tree (lazy init) if nothing ran yet;
    its settings are final then (the root keeps its params after forward)."""
    state = state_of(model)
    if state is None:
        raise ValueError(
            f"keep_unsharded: {type(model).__name__} is not a fully_shard module: pass the "
            "root of the tree (the module fully_shard was called on last)"
        )
    if state.ctx is None:
        state.lazy_init()
    if not state.is_root:
        raise ValueError(
            f"keep_unsharded: {type(model).__name__} is not its tree's root (a forward ran "
            "through another module first): pass that root"
        )
    return state
