"""How FSDP communicates in eager mode: the c10d calls of a group's collectives.

Inputs in, a small frozen dataclass out; *when* to call these is comm_context.py's and
param_group.py's business, *what* they carry the group's description's
(comm_description.py), and the arithmetic around them comm_math.py's, which graph mode
shares ([Note: one description, two executors]).

Backends differ in what they do well, so the reduce-scatter has two implementations,
picked per backward by `ReductionOps.choose` from the backend that serves the
gradients' device:

- ``all_to_all_single`` then a local sum (gloo): gloo implements
  ``reduce_scatter_tensor`` as a full all-reduce plus a copy, about twice the ring
  traffic; an all-to-all moves exactly (W-1)/W of the buffer, and the W-way sum is cheap
  on the CPU that does it anyway. gloo also lacks ``PREMUL_SUM``, so the average is a
  divide after the sum.
- the group's reduce-scatter strategy (comm_strategies.py: ``reduce_scatter_tensor`` on
  a 1-D input by default) on NCCL, every other backend, and process groups that cannot
  name their backend, such as torch's threaded test group: one ring reduce-scatter,
  (W-1)/W of the buffer on the wire per rank. ``ReduceOp.AVG`` only on NCCL, which
  divides inside the kernel, and only over more than one rank; else SUM and one divide
  after.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import AllGather, ReduceScatter
from .comm_description import ReductionOps
from .comm_math import (
    QuantizedRows,
    QuantizedSums,
    decoded_sums,
    encoded_partial_sum,
    quantized_send_rows,
    quantized_sum_rows,
    sum_all_to_all,
    sum_quantized_rows,
)
from .comm_strategies import all_gather_single as _all_gather_single
from .storage import free_storage


@dataclass(frozen=True)
class AllGatherResult:
    """An issued all-gather. ``output`` is valid once ``work`` (if any) is waited."""

    output: torch.Tensor  # (W * shard_nbytes,) uint8, rank-major
    work: dist.Work | None


def all_gather(
    all_gather_input: torch.Tensor, group: dist.ProcessGroup, strategy: AllGather
) -> AllGatherResult:
    """Issue one asynchronous all-gather of this rank's whole group of padded shards.

    Args:
        all_gather_input: (shard_nbytes,) uint8, read in place (no copy-in).
        strategy: allocates the output and runs the collective (comm_strategies.py:
            the default, a setter's, or a user's ``set_custom_all_gather``).
    """
    if group.size() == 1:
        # One rank: the output is the input, as in torch's FSDP2, which issues nothing
        # either (a custom all-gather included). The copy-out still copies.
        return AllGatherResult(output=all_gather_input, work=None)
    size = (group.size() * all_gather_input.numel(),)
    output = strategy.allocate(size, dtype=torch.uint8, device=all_gather_input.device)
    return AllGatherResult(output=output, work=strategy(output, all_gather_input, group, async_op=True))


@dataclass(frozen=True)
class ReduceScatterResult:
    """An issued reduce-scatter; `finish_reduce_scatter` turns it into averaged chunks."""

    # (W, shard_numel); referenced until the wait so it is not reused (all-to-all: then
    # `finish_reduce_scatter` frees its storage)
    input: torch.Tensor
    output: torch.Tensor  # (shard_numel,) or, for all-to-all, (W, shard_numel)
    work: dist.Work | None
    ops: ReductionOps
    input_nbytes: int  # the padded (W, shard_numel) input, for traces


def reduce_scatter(
    reduce_input: torch.Tensor,
    group: dist.ProcessGroup,
    ops: ReductionOps,
    strategy: ReduceScatter,
    async_op: bool,
) -> ReduceScatterResult:
    """Issue one reduce-scatter of a `copy_in_grads` input (comm_math.py).

    Args:
        reduce_input: (W, shard_numel), row r for rank r. The caller has dropped the
            gradients copied into it first, so they are freed before the all-to-all's
            receive buffer (as large as the input) is allocated.
        strategy: the group's reduce-scatter (comm_strategies.py); ``ops.custom``
            when it has one.
    """
    world_size, shard_numel = reduce_input.shape
    reduce_dtype, device = reduce_input.dtype, reduce_input.device
    nbytes = reduce_input.numel() * reduce_input.element_size()
    if world_size == 1:
        # One rank: its chunk is the whole buffer, and nothing is issued (as in torch's
        # FSDP2, a custom reduce-scatter included).
        local = dataclasses.replace(ops, use_all_to_all=False, custom=None)
        return ReduceScatterResult(reduce_input, reduce_input.view(-1), None, local, nbytes)
    if ops.use_all_to_all:
        output = torch.empty_like(reduce_input)  # (W, shard_numel): every rank's chunk r
        work = dist.all_to_all_single(output, reduce_input, group=group, async_op=async_op)
    else:
        op = dist.ReduceOp.AVG if ops.average_in_reduce_scatter else dist.ReduceOp.SUM
        comm = ops.custom if ops.custom is not None else strategy
        output = comm.allocate((shard_numel,), dtype=reduce_dtype, device=device)
        work = comm(output, reduce_input.view(-1), group, op, async_op=async_op)
    return ReduceScatterResult(reduce_input, output, work, ops, nbytes)


def finish_reduce_scatter(result: ReduceScatterResult) -> torch.Tensor:
    """This rank's reduced chunk, (shard_numel,), once ``result.work`` is waited: summed,
    or averaged if ``ops.average_in_reduce_scatter``."""
    if result.ops.use_all_to_all:
        # The all-to-all has landed, so nothing reads its input again: free it before
        # the sum allocates this rank's chunk. The peak is then the receive buffer and
        # the chunk, as torch's is its input and its output (gloo's own copies inside
        # reduce_scatter_tensor aside).
        free_storage(result.input)
        return sum_all_to_all(result.output)
    return result.output


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> dist.Work | None:
    """Issue the sum, or with ``average`` the average, of ``tensor`` in place over
    ``group`` (HSDP's replicate axis); ``tensor`` holds it once the returned work is
    waited. ``average`` only where ``ReductionOps`` chose AVG for it."""
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


@dataclass(frozen=True)
class QuantizedReduceScatterResult:
    """An issued quantized reduce-scatter (``CommPrecisionPolicy.reduce_scatter``): one
    all-to-all of every rank's chunks, exact ones as ``reduce_dtype`` bytes, quantized ones
    encoded; `finish_quantized_reduce_scatter` decodes and sums them in fp32."""

    input: torch.Tensor  # (W, exact_nbytes + wire.nbytes) uint8: row r goes to rank r
    output: torch.Tensor  # (W, same) uint8: row r came from rank r
    work: dist.Work | None
    ops: ReductionOps
    input_nbytes: int
    layout: QuantizedRows


def quantized_reduce_scatter(
    grads: list[torch.Tensor],
    is_quantized: Sequence[bool],
    reduce_dtype: torch.dtype,
    pre_divisor: float,
    group: dist.ProcessGroup,
    ops: ReductionOps,
    fmt: str,
    block_size: int,
    residuals: list[torch.Tensor | None] | None,
) -> QuantizedReduceScatterResult:
    """Issue one all-to-all carrying, for each destination rank, its chunk of every grad
    (`comm_math.quantized_send_rows`: the exact ones as ``reduce_dtype`` bytes, the
    quantized ones block-wise encoded, error feedback in ``residuals``). Takes
    ``grads``, as `comm_math.reduction_input` does."""
    send, layout = quantized_send_rows(
        grads, is_quantized, reduce_dtype, pre_divisor, group.size(), fmt, block_size, residuals
    )
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return QuantizedReduceScatterResult(send, recv, work, ops, send.numel(), layout)


def finish_quantized_reduce_scatter(result: QuantizedReduceScatterResult) -> torch.Tensor:
    """This rank's summed chunk of every grad, (shard_numel,) in ``reduce_dtype``, once
    ``result.work`` is waited."""
    return sum_quantized_rows(result.output, result.layout)


@dataclass(frozen=True)
class QuantizedAllReduceResult:
    """An issued `quantized_all_reduce`: its all-to-all is in flight;
    `finish_quantized_all_reduce` sums, gathers and decodes."""

    recv: torch.Tensor  # (R, wire.nbytes) uint8: row r came from rank r
    work: dist.Work | None
    group: dist.ProcessGroup
    layout: QuantizedSums
    nbytes: int  # bytes this rank sends (all-to-all and all-gather inputs)


def quantized_all_reduce(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, fmt: str, block_size: int
) -> QuantizedAllReduceResult:
    """Issue the sum of each of ``tensors`` (1-D) over ``group`` with quantized wire bytes
    and fp32 sums: an all-to-all of encoded chunks (each rank sums its chunk in fp32 after
    decoding), then, in `finish_quantized_all_reduce`, an all-gather of the encoded sums.
    HSDP's inter-node leg (ZeRO++'s qgZ); the all-to-all is in flight when this returns.
    """
    send, layout = quantized_sum_rows(tensors, group.size(), fmt, block_size)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    # The all-gather input is one encoded chunk: wire.nbytes bytes.
    return QuantizedAllReduceResult(recv, work, group, layout, send.numel() + layout.wire.nbytes)


def finish_quantized_all_reduce(result: QuantizedAllReduceResult) -> list[torch.Tensor]:
    """Each input's sum over the group, in the input's dtype: waits for the all-to-all,
    sums this rank's chunk, then all-gathers the encoded sums (synchronously: the
    decoded totals are needed right away)."""
    if result.work is not None:
        result.work.wait()
    mine = encoded_partial_sum(result.recv, result.layout)  # (wire.nbytes,)
    gathered = torch.empty(
        result.group.size() * mine.numel(), dtype=torch.uint8, device=mine.device
    )
    _all_gather_single(gathered, mine, group=result.group)
    return decoded_sums(gathered, result.layout)
