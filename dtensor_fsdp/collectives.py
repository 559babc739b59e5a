"""How FSDP communicates: stateless all-gather, copy-out and reduce-scatter.

Inputs in, a small frozen dataclass out; *when* to call these is scheduler.py's and
param_group.py's business.

Backends differ in what they do well, so the reduce-scatter has two implementations,
picked once per process group by `ReduceScatterPlan.for_group`:

- ``reduce_scatter_tensor`` (NCCL and others), with ``ReduceOp.AVG`` on NCCL unless a
  custom divide factor or sum-only reduction is asked for: one ring reduce-scatter,
  (W-1)/W of the buffer on the wire per rank.
- ``all_to_all_single`` then a local sum (gloo): gloo implements
  ``reduce_scatter_tensor`` as a full all-reduce plus a copy, about twice the ring
  traffic; an all-to-all moves exactly (W-1)/W of the buffer, and the W-way sum is cheap
  on the CPU that does it anyway. gloo also lacks ``PREMUL_SUM``, so the average is a
  divide after the sum.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._tensor_utils import chunk_rows
from .api import AllGather, ReduceScatter

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; 2.11
# has only the old ones. Same signature either way.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class AllGatherResult:
    """An issued all-gather. ``output`` is valid once ``work`` (if any) is waited."""

    output: torch.Tensor  # (W * shard_nbytes,) uint8, rank-major
    work: dist.Work | None


@dataclass(frozen=True)
class ReduceScatterPlan:
    """How one group's gradients are reduce-scattered, decided per backward."""

    use_all_to_all: bool  # gloo: all-to-all then a local sum
    average_in_collective: bool  # ReduceOp.AVG; else SUM, and the caller divides
    custom: ReduceScatter | None = None  # set_custom_reduce_scatter

    @staticmethod
    def choose(
        group: dist.ProcessGroup, *, prefer_average: bool, custom: ReduceScatter | None
    ) -> "ReduceScatterPlan":
        if custom is not None:
            return ReduceScatterPlan(
                use_all_to_all=False, average_in_collective=False, custom=custom
            )
        backend = dist.get_backend(group)
        if backend == "gloo":
            return ReduceScatterPlan(use_all_to_all=True, average_in_collective=False)
        return ReduceScatterPlan(
            use_all_to_all=False, average_in_collective=prefer_average and backend == "nccl"
        )


@dataclass(frozen=True)
class ReduceScatterResult:
    """An issued reduce-scatter; `finish_reduce_scatter` turns it into averaged chunks."""

    input: torch.Tensor  # (W, shard_numel); referenced until the wait so it is not reused
    output: torch.Tensor  # (shard_numel,) or, for all-to-all, (W, shard_numel)
    work: dist.Work | None
    plan: ReduceScatterPlan
    input_nbytes: int  # the padded (W, shard_numel) input, for traces


def all_gather(
    all_gather_input: torch.Tensor, group: dist.ProcessGroup, custom: AllGather | None
) -> AllGatherResult:
    """Issue one asynchronous all-gather of this rank's whole group of padded shards.

    Args:
        all_gather_input: (shard_nbytes,) uint8, read in place (no copy-in).
        custom: a user ``AllGather`` (``set_custom_all_gather``) to allocate and run it.
    """
    size = (group.size() * all_gather_input.numel(),)
    device = all_gather_input.device
    if custom is not None:
        output = custom.allocate(size, dtype=torch.uint8, device=device)
        return AllGatherResult(
            output=output, work=custom(output, all_gather_input, group, async_op=True)
        )
    output = torch.empty(size, dtype=torch.uint8, device=device)
    work = _all_gather_single(output, all_gather_input, group=group, async_op=True)
    return AllGatherResult(output=output, work=work)


def copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    split_nbytes: list[int],
    outputs: list[torch.Tensor],
) -> None:
    """Scatter the rank-major all-gather output into each parameter's padded buffer.

    Args:
        all_gather_output: (W * shard_nbytes,) uint8.
        split_nbytes: each parameter's padded shard bytes, in buffer order.
        outputs: each parameter's padded unsharded buffer as (W, padded_shard_nbytes) uint8.
    """
    rows = all_gather_output.view(world_size, -1)  # (W, shard_nbytes)
    torch.split_with_sizes_copy(rows, split_nbytes, dim=1, out=outputs)


def reduce_scatter(
    unsharded_grads: list[torch.Tensor],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    plan: ReduceScatterPlan,
    async_op: bool,
) -> ReduceScatterResult:
    """Copy the gradients into one buffer (padding each to W equal chunks) and issue one
    reduce-scatter of it.

    Args:
        unsharded_grads: each of the original param's shape, all of ``reduce_dtype``.
    """
    world_size = group.size()
    # (W, sum of padded shard numels): row r holds rank r's padded chunk of every grad.
    shard_numel = sum(_padded_chunk_numel(g, world_size) for g in unsharded_grads)
    device = unsharded_grads[0].device
    reduce_input = torch.empty((world_size, shard_numel), dtype=reduce_dtype, device=device)
    torch._chunk_cat(unsharded_grads, dim=0, num_chunks=world_size, out=reduce_input)
    op = dist.ReduceOp.AVG if plan.average_in_collective else dist.ReduceOp.SUM
    if plan.custom is not None:
        output = plan.custom.allocate((shard_numel,), dtype=reduce_dtype, device=device)
        work = plan.custom(output, reduce_input.view(-1), group, op, async_op=async_op)
    elif plan.use_all_to_all:
        output = torch.empty_like(reduce_input)  # (W, shard_numel): every rank's chunk r
        work = dist.all_to_all_single(output, reduce_input, group=group, async_op=async_op)
    else:
        output = torch.empty(shard_numel, dtype=reduce_dtype, device=device)
        work = _reduce_scatter_single(output, reduce_input, op=op, group=group, async_op=async_op)
    return ReduceScatterResult(
        input=reduce_input,
        output=output,
        work=work,
        plan=plan,
        input_nbytes=reduce_input.numel() * reduce_input.element_size(),
    )


def finish_reduce_scatter(result: ReduceScatterResult) -> torch.Tensor:
    """This rank's reduced chunk, (shard_numel,), once ``result.work`` is waited: summed,
    or averaged if ``plan.average_in_collective``."""
    if result.plan.use_all_to_all:
        # A fresh (shard_numel,) tensor, not a view of the (W, shard_numel) receive
        # buffer: the sharded grads are views of what this returns, and must not keep
        # W times their size alive.
        return result.output.sum(dim=0)
    return result.output


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> None:
    """Sum, or with ``average`` average, ``tensor`` in place over ``group`` (HSDP's
    replicate axis). ``average`` only where the plan chose AVG for its backend."""
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)


def _padded_chunk_numel(tensor: torch.Tensor, world_size: int) -> int:
    return chunk_rows(tensor.shape[0], world_size) * math.prod(tensor.shape[1:])
