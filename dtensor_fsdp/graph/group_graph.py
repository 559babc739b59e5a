"""What graph mode reads from each eager group, once, when it is enabled.

A group's `GroupGraph`: its `GroupComm` (the eager runtime's own description:
``group.all_gather_layout.description`` and ``group.reduction.describe``), where its
gathered tensors are bound, and the tensors that carry state between steps (the
micro-batch sums, error feedback's residuals).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.comm_description import GroupComm
from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from .collectives import hook_name, op_name
from .gather import GatherPlan, PostForwardGroups


@dataclass(frozen=True)
class BoundParam:
    """Where one gathered tensor is bound, and how it is presented (TP: as a DTensor)."""

    slots: tuple[tuple[nn.Module, str], ...]
    fsdp_param: FSDPParam


@dataclass(frozen=True)
class GroupGraph:
    """One group in graph mode: what it gathers, where it binds it, its step state."""

    index: int  # the group's place in its root's tree (a session's key)
    plan: GatherPlan
    params: tuple[BoundParam, ...]  # in the all-gather's param order
    group: FSDPParamGroup  # read at each trace: requires_gradient_sync, requires_all_reduce
    # Gradient accumulation without sync: a leaf whose ``.grad`` sums the micro-batches'
    # unsharded gradients, (W, trainable padded numel) (gather.py). Expanded from one
    # element: it holds no memory.
    accumulator: torch.Tensor
    # HSDP without all-reduce: a leaf whose ``.grad`` sums the shard-reduced chunks.
    partial: torch.Tensor
    # Error feedback: per reduced param, its residual (error_feedback.py's tensor).
    residuals: tuple[torch.Tensor | None, ...]


def group_graph(
    group: FSDPParamGroup, index: int, process_groups: dict[tuple[int, ...], dist.ProcessGroup]
) -> GroupGraph:
    """``group`` as graph mode runs it, with its settings as they are now.
    ``process_groups``: hpZ's groups made so far for this root, by ranks."""
    params = group.all_gather_layout.params
    trainable = tuple(p.requires_grad for p in params)
    reduced = [p for p in params if p.requires_grad]
    description = group.reduction.describe(reduced) if reduced else None
    mesh_info = group.mesh_info
    comm = GroupComm(
        all_gather=group.all_gather_layout.description,
        reduction=description,
        group_name=mesh_info.shard_group.group_name,
        world_size=mesh_info.shard_size,
        reduce_group_name=group.reduction.reduce_scatter_group.group_name,
        replicate_group_name=mesh_info.replicate_group.group_name if mesh_info.is_hsdp else None,
        replicate_size=mesh_info.replicate_size,
    )
    hook = description.hook if description is not None else None
    plan = GatherPlan(
        comm=comm,
        all_gather_op=op_name(group.all_gather_comm),
        reduce_scatter_op=op_name(description.strategy) if description is not None else None,
        hook_op=hook_name(hook) if hook is not None else None,
        trainable=trainable,
        device=group.device,
        sharded_device=group.sharded_buffer.device,
        # lazy_init already cleared it for a root left to decide (torch's default).
        reshard=bool(group.reshard_after_forward),
        post_forward=_post_forward_groups(group, process_groups),
        fqn=group.fqn,
    )
    feedback = group.reduction.error_feedback
    residuals: tuple[torch.Tensor | None, ...] = ()
    if description is not None and description.error_feedback:
        residuals = tuple(
            feedback.residual(p) if q else None
            for p, q in zip(reduced, description.quantized, strict=True)
        )
    return GroupGraph(
        index=index,
        plan=plan,
        params=tuple(BoundParam(tuple((s.module, s.name) for s in p.slots), p) for p in params),
        group=group,
        accumulator=_leaf((comm.world_size, _numel(reduced)), description, group.device),
        partial=_leaf((_numel(reduced),), description, group.device),
        residuals=residuals,
    )


def _post_forward_groups(
    group: FSDPParamGroup, process_groups: dict[tuple[int, ...], dist.ProcessGroup]
) -> PostForwardGroups | None:
    """hpZ's two stages (`PostForwardGroups`): the block is eager's post-forward
    group; the ranks at one place of every block of this rank's replica get a process
    group of their own, made by its members only (local synchronization), once per
    rank set and root."""
    post_forward = group.post_forward_mesh_info
    if post_forward is None or not group.reshard_after_forward:
        return None
    mesh_info = group.mesh_info
    k = post_forward.shard_size
    shard_ranks = dist.get_process_group_ranks(mesh_info.shard_group)  # (W,), in rank order
    place = mesh_info.shard_rank % k
    across = tuple(shard_ranks[place::k])  # (W/k,): one per block
    if across not in process_groups:
        process_groups[across] = dist.new_group(
            list(across), use_local_synchronization=True, group_desc="dtensor_fsdp_hpz_across"
        )
    return PostForwardGroups(
        across=process_groups[across].group_name,
        across_size=len(across),
        block=post_forward.shard_group.group_name,
        block_size=k,
    )


def _numel(params: list[FSDPParam]) -> int:
    return sum(p.padded_shard_numel for p in params)


def _leaf(shape: tuple[int, ...], description: object, device: torch.device) -> torch.Tensor:
    dtype = description.reduce_dtype if description is not None else torch.float32
    zero = torch.zeros((1,) * len(shape), dtype=dtype, device=device)
    return zero.expand(shape).requires_grad_()
