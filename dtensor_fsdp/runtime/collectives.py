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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import AllGather, ReduceScatter
from ..comm_precision.wire_format import WireLayout, decode, decode_sum, encode
from .mesh import backend_for
from .tensor_utils import chunk_rows, free_storage

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

    # (W, shard_numel); referenced until the wait so it is not reused (all-to-all: then
    # `finish_reduce_scatter` frees its storage)
    input: torch.Tensor
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
    if group.size() == 1:
        # One rank: the output is the input, as in torch's FSDP2, which issues nothing
        # either (a custom all-gather included). The copy-out still copies.
        return AllGatherResult(output=all_gather_input, work=None)
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


@dataclass(frozen=True)
class AllGatherInput:
    """A copied-in all-gather input: exactly copied columns, then any encoded ones."""

    input: torch.Tensor  # (bytes per rank,) uint8
    split_nbytes: list[int]  # bytes of each exactly copied column, in order


def copy_in(
    plain_shards: list[torch.Tensor],
    plain_dtypes: Sequence[torch.dtype],
    extension_inputs: list[torch.Tensor],
    wire: WireLayout | None,
    wire_segments: list[torch.Tensor],
) -> AllGatherInput:
    """Build a fresh all-gather input when the sharded buffer cannot be sent in place:
    mixed precision casts, all-gather extensions, or quantized params.

    Args:
        plain_shards: padded shards copied exactly, each cast to its ``plain_dtypes``
            entry (the wire carries param_dtype). Largest dtype first, so every cast
            writes an aligned view. One foreach kernel.
        extension_inputs: ``fsdp_pre_all_gather``'s inputs, 1-D each, copied as bytes
            (one may sit at any byte offset).
        wire: the encoded columns' layout (``CommPrecisionPolicy.all_gather``), or None.
        wire_segments: (1, n_i) each: what ``wire`` encodes.
    """
    device = (plain_shards or extension_inputs or wire_segments)[0].device
    split = [
        t.numel() * dtype.itemsize for t, dtype in zip(plain_shards, plain_dtypes, strict=True)
    ]
    split += [t.numel() * t.itemsize for t in extension_inputs]
    exact_nbytes = sum(split)
    all_gather_input = torch.empty(
        exact_nbytes + (wire.nbytes if wire is not None else 0), dtype=torch.uint8, device=device
    )  # (bytes per rank,)
    columns = all_gather_input[:exact_nbytes].split(split)
    if plain_shards:
        torch._foreach_copy_(
            [
                column.view(dtype).view(shard.shape)
                for column, shard, dtype in zip(
                    columns[: len(plain_shards)], plain_shards, plain_dtypes, strict=True
                )
            ],
            plain_shards,
        )
    if extension_inputs:
        torch._foreach_copy_(
            list(columns[len(plain_shards) :]), [t.view(torch.uint8) for t in extension_inputs]
        )
    if wire is not None:
        encode(wire_segments, wire, all_gather_input[exact_nbytes:].view(1, -1))
    return AllGatherInput(all_gather_input, split)


def copy_out(
    rows: torch.Tensor,
    split_nbytes: Sequence[int],
    outputs: list[torch.Tensor],
) -> None:
    """Scatter the rank-major all-gather output into each parameter's padded buffer.

    Args:
        rows: (W, sum of split_nbytes) uint8: the all-gather output, row r from rank r
            (or the exactly copied columns of it).
        split_nbytes: each column's bytes per rank, in order.
        outputs: where each column goes, as (W, its bytes) uint8 (a padded unsharded
            buffer, or an all-gather extension's output).
    """
    if outputs:
        torch.split_with_sizes_copy(rows, split_nbytes, dim=1, out=outputs)


def copy_in_grads(
    unsharded_grads: list[torch.Tensor], reduce_dtype: torch.dtype, world_size: int
) -> torch.Tensor:
    """One reduce-scatter input of the gradients, cast to ``reduce_dtype`` while they are
    copied in (torch's ``chunk_cat``): no per-gradient cast temporaries.

    Args:
        unsharded_grads: each of the original param's shape (any float dtype), arranged
            so that its dim-0 chunks are the ranks' shards.

    Returns:
        (W, sum of padded shard numels): row r holds rank r's padded chunk of every grad.
    """
    if len({g.dtype for g in unsharded_grads}) > 1:
        # `_chunk_cat` needs one input dtype. Mixed only after micro-batches without
        # sync under mixed precision: a param with a grad in an earlier micro-batch
        # brings its reduce_dtype accumulator, one first used in the last its
        # param_dtype grad (or zeros, reduce_scatter_unused_params). torch's FSDP2
        # refuses this case; casting the odd ones is exact (a widening cast).
        unsharded_grads = [g.to(reduce_dtype) for g in unsharded_grads]
    shard_numel = sum(_padded_chunk_numel(g, world_size) for g in unsharded_grads)
    reduce_input = torch.empty(
        (world_size, shard_numel), dtype=reduce_dtype, device=unsharded_grads[0].device
    )
    torch._chunk_cat(unsharded_grads, dim=0, num_chunks=world_size, out=reduce_input)
    return reduce_input


def reduce_scatter(
    reduce_input: torch.Tensor,
    group: dist.ProcessGroup,
    plan: ReductionPlan,
    async_op: bool,
) -> ReduceScatterResult:
    """Issue one reduce-scatter of a `copy_in_grads` input.

    Args:
        reduce_input: (W, shard_numel), row r for rank r. The caller has dropped the
            gradients copied into it first, so they are freed before the all-to-all's
            receive buffer (as large as the input) is allocated.
    """
    world_size, shard_numel = reduce_input.shape
    reduce_dtype, device = reduce_input.dtype, reduce_input.device
    nbytes = reduce_input.numel() * reduce_input.element_size()
    if world_size == 1:
        # One rank: its chunk is the whole buffer, and nothing is issued (as in torch's
        # FSDP2, a custom reduce-scatter included).
        local = dataclasses.replace(plan, use_all_to_all=False, custom=None)
        return ReduceScatterResult(reduce_input, reduce_input.view(-1), None, local, nbytes)
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
        input_nbytes=nbytes,
    )


def finish_reduce_scatter(result: ReduceScatterResult) -> torch.Tensor:
    """This rank's reduced chunk, (shard_numel,), once ``result.work`` is waited: summed,
    or averaged if ``plan.average_in_reduce_scatter``."""
    if result.plan.use_all_to_all:
        # The all-to-all has landed, so nothing reads its input again: free it before
        # the sum allocates this rank's chunk. The peak is then the receive buffer and
        # the chunk, as torch's is its input and its output (gloo's own copies inside
        # reduce_scatter_tensor aside).
        free_storage(result.input)
        # A fresh (shard_numel,) tensor, not a view of the (W, shard_numel) receive
        # buffer: the sharded grads are views of what this returns, and must not keep
        # W times their size alive.
        return result.output.sum(dim=0)
    return result.output


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> dist.Work | None:
    """Issue the sum, or with ``average`` the average, of ``tensor`` in place over
    ``group`` (HSDP's replicate axis); ``tensor`` holds it once the returned work is
    waited. ``average`` only where ``ReductionPlan`` chose AVG for it."""
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def _padded_chunk_numel(tensor: torch.Tensor, world_size: int) -> int:
    return chunk_rows(tensor.shape[0], world_size) * math.prod(tensor.shape[1:])


@dataclass(frozen=True)
class QuantizedReduceScatterResult:
    """An issued quantized reduce-scatter (``CommPrecisionPolicy.reduce_scatter``): one
    all-to-all of every rank's chunks, exact ones as ``reduce_dtype`` bytes, quantized ones
    encoded; `finish_reduce_scatter` decodes and sums them in fp32."""

    input: torch.Tensor  # (W, exact_nbytes + wire.nbytes) uint8: row r goes to rank r
    output: torch.Tensor  # (W, same) uint8: row r came from rank r
    work: dist.Work | None
    plan: ReductionPlan
    input_nbytes: int
    exact_numels: list[int]  # per exact grad, its chunk's elements (in the row's order)
    wire: WireLayout
    is_quantized: list[bool]  # per grad in the caller's order
    reduce_dtype: torch.dtype


def quantized_reduce_scatter(
    unsharded_grads: list[torch.Tensor],
    is_quantized: list[bool],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    plan: ReductionPlan,
    fmt: str,
    block_size: int,
    residuals: list[torch.Tensor | None] | None,
) -> QuantizedReduceScatterResult:
    """Issue one all-to-all carrying, for each destination rank, its chunk of every grad:
    the exact ones as ``reduce_dtype`` bytes, the quantized ones block-wise encoded.

    Args:
        unsharded_grads: each of the original param's shape, all of ``reduce_dtype``.
        is_quantized: per grad, whether it travels encoded.
        residuals: error feedback (or None): per grad, None or its (W, chunk numel) fp32
            quantization error from the last step, added before encoding and replaced in
            place by this step's.
    """
    world_size = group.size()
    device = unsharded_grads[0].device
    exact = [g for g, q in zip(unsharded_grads, is_quantized, strict=True) if not q]
    exact_numels = [_padded_chunk_numel(g, world_size) for g in exact]
    chunks = []  # per quantized grad, (W, padded chunk numel): row r is rank r's chunk
    for grad, quantized in zip(unsharded_grads, is_quantized, strict=True):
        if quantized:
            rows = torch.empty(
                (world_size, _padded_chunk_numel(grad, world_size)), dtype=grad.dtype, device=device
            )
            torch._chunk_cat([grad], dim=0, num_chunks=world_size, out=rows)
            chunks.append(rows)
    wire = WireLayout(fmt, block_size, tuple(c.shape[1] for c in chunks))
    exact_nbytes = sum(exact_numels) * reduce_dtype.itemsize
    send = torch.empty((world_size, exact_nbytes + wire.nbytes), dtype=torch.uint8, device=device)
    if exact:
        exact_rows = torch.empty((world_size, sum(exact_numels)), dtype=reduce_dtype, device=device)
        torch._chunk_cat(exact, dim=0, num_chunks=world_size, out=exact_rows)
        send[:, :exact_nbytes].copy_(exact_rows.view(torch.uint8))
    residual_list = (
        [r for r, q in zip(residuals, is_quantized, strict=True) if q] if residuals else None
    )
    if residual_list is not None:
        # Error feedback: send g + e, keep e' = (g + e) - decode(encode(g + e)).
        chunks = [
            c.float().add_(r) if r is not None else c.float()
            for c, r in zip(chunks, residual_list, strict=True)
        ]
    encode(chunks, wire, send[:, exact_nbytes:])
    if residual_list is not None:
        sent = [torch.empty_like(c) for c in chunks]
        decode(send[:, exact_nbytes:], wire, sent)
        for residual, chunk, decoded in zip(residual_list, chunks, sent, strict=True):
            if residual is not None:
                torch.sub(chunk, decoded, out=residual)
                # A non-finite block decodes to NaN/inf: carrying that into every later
                # step would poison the block for good (one skipped fp16 step would make
                # GradScaler skip forever). Its error is dropped instead.
                residual.masked_fill_(~torch.isfinite(residual), 0.0)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return QuantizedReduceScatterResult(
        input=send,
        output=recv,
        work=work,
        plan=plan,
        input_nbytes=send.numel(),
        exact_numels=exact_numels,
        wire=wire,
        is_quantized=is_quantized,
        reduce_dtype=reduce_dtype,
    )


def finish_quantized_reduce_scatter(result: QuantizedReduceScatterResult) -> torch.Tensor:
    """This rank's summed chunk of every grad, (shard_numel,) in ``reduce_dtype``, in the
    grads' order, once ``result.work`` is waited. Exact chunks are summed in
    ``reduce_dtype`` as the exact path does; quantized ones in fp32 after decoding."""
    exact_nbytes = sum(result.exact_numels) * result.reduce_dtype.itemsize
    # (W, exact elements): contiguous first, the row stride may not fit the dtype's size.
    exact_sum = result.output[:, :exact_nbytes].contiguous().view(result.reduce_dtype).sum(dim=0)
    exact_iter = iter(exact_sum.split(result.exact_numels))
    quantized_iter = iter(decode_sum(result.output[:, exact_nbytes:], result.wire))
    parts = [
        next(quantized_iter) if quantized else next(exact_iter) for quantized in result.is_quantized
    ]
    return torch.cat([p.to(result.reduce_dtype) for p in parts])


@dataclass(frozen=True)
class QuantizedAllReduceResult:
    """An issued `quantized_all_reduce`: its all-to-all is in flight;
    `finish_quantized_all_reduce` sums, gathers and decodes."""

    recv: torch.Tensor  # (R, wire.nbytes) uint8: row r came from rank r
    work: dist.Work | None
    group: dist.ProcessGroup
    wire: WireLayout  # one segment: this rank's chunk of whole blocks
    offsets: list[int]  # where each input starts in the padded (R * chunk,) buffer
    inputs: list[torch.Tensor]  # the inputs, for their numels and dtypes
    nbytes: int  # bytes this rank sends (all-to-all and all-gather inputs)


def quantized_all_reduce(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, fmt: str, block_size: int
) -> QuantizedAllReduceResult:
    """Issue the sum of each of ``tensors`` (1-D) over ``group`` with quantized wire bytes
    and fp32 sums: an all-to-all of encoded chunks (each rank sums its chunk in fp32 after
    decoding), then, in `finish_quantized_all_reduce`, an all-gather of the encoded sums.
    HSDP's inter-node leg (ZeRO++'s qgZ); the all-to-all is in flight when this returns.

    Each tensor starts on a block boundary and each rank's chunk is whole blocks, so no
    block mixes two parameters (a small gradient keeps its own scale, as on the other
    legs).
    """
    size = group.size()
    device = tensors[0].device
    padded_numels = [math.ceil(t.numel() / block_size) * block_size for t in tensors]
    blocks = sum(padded_numels) // block_size
    chunk = math.ceil(blocks / size) * block_size  # elements per rank, whole blocks
    padded = torch.zeros(size * chunk, dtype=torch.float32, device=device)  # (R * chunk,)
    offsets = [0]
    for numel in padded_numels[:-1]:
        offsets.append(offsets[-1] + numel)
    for tensor, offset in zip(tensors, offsets, strict=True):
        padded[offset : offset + tensor.numel()].copy_(tensor)
    wire = WireLayout(fmt, block_size, (chunk,))
    send = torch.empty((size, wire.nbytes), dtype=torch.uint8, device=device)
    encode([padded.view(size, chunk)], wire, send)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    # The all-gather input is one encoded chunk: wire.nbytes bytes.
    return QuantizedAllReduceResult(
        recv, work, group, wire, offsets, tensors, nbytes=send.numel() + wire.nbytes
    )


def finish_quantized_all_reduce(result: QuantizedAllReduceResult) -> list[torch.Tensor]:
    """Each input's sum over the group, in the input's dtype: waits for the all-to-all,
    sums this rank's chunk, then all-gathers the encoded sums (synchronously: the
    decoded totals are needed right away)."""
    if result.work is not None:
        result.work.wait()
    size, wire, device = result.group.size(), result.wire, result.recv.device
    (chunk,) = wire.numels
    (my_sum,) = decode_sum(result.recv, wire)  # (chunk,) fp32: this rank's chunk, summed
    mine = torch.empty((1, wire.nbytes), dtype=torch.uint8, device=device)
    encode([my_sum.view(1, chunk)], wire, mine)
    gathered = torch.empty((size, wire.nbytes), dtype=torch.uint8, device=device)
    _all_gather_single(gathered.view(-1), mine.view(-1), group=result.group)
    total = torch.empty((size, chunk), dtype=torch.float32, device=device)
    decode(gathered, wire, [total])
    flat = total.view(-1)  # (R * chunk,)
    return [
        flat[offset : offset + t.numel()].to(t.dtype)
        for t, offset in zip(result.inputs, result.offsets, strict=True)
    ]
