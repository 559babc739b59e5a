"""How FSDP communicates: stateless all-gather, copy-out and reduce-scatter.

Inputs in, a small frozen dataclass out; *when* to call these is scheduler.py's and
param_group.py's business.

Backends differ in what they do well, so the reduce-scatter has two implementations,
picked per backward by `ReductionPlan.choose` from the backend that serves the
gradients' device (``ProcessGroup._get_backend(device)``), never from the backend's
name: ``init_process_group()`` reports ``"undefined"``, and ``"cuda:nccl,cpu:gloo"``
names two backends.

- ``all_to_all_single`` then a local sum (gloo): gloo implements
  ``reduce_scatter_tensor`` as a full all-reduce plus a copy, about twice the ring
  traffic; an all-to-all moves exactly (W-1)/W of the buffer, and the W-way sum is cheap
  on the CPU that does it anyway. gloo also lacks ``PREMUL_SUM``, so the average is a
  divide after the sum.
- ``reduce_scatter_tensor`` on a 1-D input (NCCL, every other backend, and process
  groups that cannot name their backend, such as torch's threaded test group): one ring
  reduce-scatter, (W-1)/W of the buffer on the wire per rank. ``ReduceOp.AVG`` only on
  NCCL, which divides inside the kernel, and only over more than one rank (NCCL's AVG
  can be wrong at world size 1; torch's FSDP2 avoids it too); else SUM and one divide
  after.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._tensor_utils import chunk_rows
from .api import AllGather, ReduceScatter
from .mesh import backend_for

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
class ReductionPlan:
    """How one group's gradients are reduced, decided per backward."""

    use_all_to_all: bool  # gloo: all-to-all then a local sum
    average_in_reduce_scatter: bool  # the reduce-scatter uses ReduceOp.AVG; else SUM
    average_in_all_reduce: bool = False  # HSDP: the replicate all-reduce uses AVG
    custom: ReduceScatter | None = None  # set_custom_reduce_scatter

    @staticmethod
    def choose(
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        prefer_average: bool,
        custom: ReduceScatter | None,
    ) -> "ReductionPlan":
        """Args:
        shard_group: the reduce-scatter's group; ``replicate_group`` HSDP's all-reduce's.
        device: where the gradients are reduced; its backend decides.
        prefer_average: let the collectives average, where they do that well.
        custom: a user ``ReduceScatter``; it gets SUM, and FSDP divides afterwards.
        """
        if custom is not None:
            return ReductionPlan(
                use_all_to_all=False, average_in_reduce_scatter=False, custom=custom
            )
        return ReductionPlan(
            use_all_to_all=_is_backend(backend_for(shard_group, device), "ProcessGroupGloo"),
            average_in_reduce_scatter=prefer_average and _averages_well(shard_group, device),
            average_in_all_reduce=prefer_average and _averages_well(replicate_group, device),
        )


def _averages_well(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """``ReduceOp.AVG`` on ``group``: NCCL only, and never over one rank."""
    return (
        group is not None
        and group.size() > 1
        and _is_backend(backend_for(group, device), "ProcessGroupNCCL")
    )


def _is_backend(backend: object | None, class_name: str) -> bool:
    # A CPU-only torch build has no ProcessGroupNCCL class at all.
    cls = getattr(dist, class_name, None)
    return cls is not None and isinstance(backend, cls)


@dataclass(frozen=True)
class ReduceScatterResult:
    """An issued reduce-scatter; `finish_reduce_scatter` turns it into averaged chunks."""

    input: torch.Tensor  # (W, shard_numel); referenced until the wait so it is not reused
    output: torch.Tensor  # (shard_numel,) or, for all-to-all, (W, shard_numel)
    work: dist.Work | None
    plan: ReductionPlan
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
        outputs: where each column goes, as (W, its bytes) uint8 (a padded unsharded
            buffer, or an all-gather extension's output).
    """
    rows = all_gather_output.view(world_size, -1)  # (W, shard_nbytes)
    torch.split_with_sizes_copy(rows, split_nbytes, dim=1, out=outputs)


def reduce_scatter(
    unsharded_grads: list[torch.Tensor],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    plan: ReductionPlan,
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
    op = dist.ReduceOp.AVG if plan.average_in_reduce_scatter else dist.ReduceOp.SUM
    if plan.custom is not None:
        output = plan.custom.allocate((shard_numel,), dtype=reduce_dtype, device=device)
        work = plan.custom(output, reduce_input.view(-1), group, op, async_op=async_op)
    elif plan.use_all_to_all:
        output = torch.empty_like(reduce_input)  # (W, shard_numel): every rank's chunk r
        work = dist.all_to_all_single(output, reduce_input, group=group, async_op=async_op)
    else:
        output = torch.empty(shard_numel, dtype=reduce_dtype, device=device)
        # 1-D, as NCCL's users pass it: backends that split the input into W chunks
        # along dim 0 (torch's threaded group) would otherwise hand out (1, n) rows.
        work = _reduce_scatter_single(
            output, reduce_input.view(-1), op=op, group=group, async_op=async_op
        )
    return ReduceScatterResult(
        input=reduce_input,
        output=output,
        work=work,
        plan=plan,
        input_nbytes=reduce_input.numel() * reduce_input.element_size(),
    )


def finish_reduce_scatter(result: ReduceScatterResult) -> torch.Tensor:
    """This rank's reduced chunk, (shard_numel,), once ``result.work`` is waited: summed,
    or averaged if ``plan.average_in_reduce_scatter``."""
    if result.plan.use_all_to_all:
        # A fresh (shard_numel,) tensor, not a view of the (W, shard_numel) receive
        # buffer: the sharded grads are views of what this returns, and must not keep
        # W times their size alive.
        return result.output.sum(dim=0)
    return result.output


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> None:
    """Sum, or with ``average`` average, ``tensor`` in place over ``group`` (HSDP's
    replicate axis). ``average`` only where ``ReductionPlan`` chose AVG for it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)


def _padded_chunk_numel(tensor: torch.Tensor, world_size: int) -> int:
    return chunk_rows(tensor.shape[0], world_size) * math.prod(tensor.shape[1:])
