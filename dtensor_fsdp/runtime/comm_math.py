"""The arithmetic of a group's collectives, on plain tensors: what both executors run.

A group's communication is described once (`GroupComm`, comm_description.py) and run by
two executors: the eager runtime (``runtime/``: c10d, streams, observers) and graph mode
(``graph/``: functional collectives inside compiled graphs). Everything between the
collectives is here, once, so that the two give the same bits: the all-gather's copy-in
and copy-out, an unsharded parameter's layout (``Shard(0)`` rows, ``Shard(dim)``
chunks side by side), the gradients' rank-major copy-in, the sum of an all-to-all, the
divisions, the quantized wire's encoding (with error feedback) and its sums, the cut of
a reduced buffer into sharded gradients.

No process group, no module state, no stream: tensors in, tensors out. Where the eager
runtime keeps persistent buffers (the unsharded parameters autograd saved, the
error-feedback residuals), a function takes them as ``out``; graph mode passes fresh
ones. Every function is traceable (dynamo, AOT autograd, inductor) as written.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm_precision.wire_format import WireLayout, decode, decode_sum, encode
from .shard_geometry import ShardGeometry, chunk_rows

# All-gather #


def pad_shard(local: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """A sharded param's local tensor (``local_shape``) as its padded shard
    (``padded_local_shape``): the padding rows on dim 0 are zeros, as in the sharded
    buffer ([Note: sharded buffer], all_gather_layout.py). ``local`` itself when it has
    no padding."""
    missing = geometry.padded_local_shape[0] - local.shape[0]
    if missing == 0:
        return local
    # F.pad pads the last dims first: (0, 0) for each trailing dim, then dim 0.
    return F.pad(local, (0, 0) * (local.dim() - 1) + (0, missing))


def cast_whole_buffer(
    sharded: torch.Tensor, dtype: torch.dtype, param_dtype: torch.dtype
) -> torch.Tensor:
    """The all-gather input of a group whose params all cast ``dtype`` to
    ``param_dtype`` (mixed precision's usual case): the sharded buffer ``sharded``
    (1-D uint8) cast in one op; its padding casts to zeros."""
    return sharded.view(dtype).to(param_dtype).view(torch.uint8)


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
    if torch.compiler.is_compiling():
        return AllGatherInput(
            _concatenated(plain_shards, plain_dtypes, extension_inputs, wire, wire_segments),
            split,
        )
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


def _concatenated(
    plain_shards: list[torch.Tensor],
    plain_dtypes: Sequence[torch.dtype],
    extension_inputs: list[torch.Tensor],
    wire: WireLayout | None,
    wire_segments: list[torch.Tensor],
) -> torch.Tensor:
    """`copy_in`'s bytes in traced code (graph mode): the same columns concatenated.
    Traced, a write into a column view of one byte buffer becomes a copy of the whole
    buffer per column (functionalization's scatter back into the base), which inductor
    does not turn back into in-place writes through a dtype view."""
    parts = [
        shard.to(dtype).reshape(-1).view(torch.uint8)
        for shard, dtype in zip(plain_shards, plain_dtypes, strict=True)
    ]
    parts += [t.view(torch.uint8) for t in extension_inputs]
    if wire is not None:
        device = (plain_shards or extension_inputs or wire_segments)[0].device
        encoded = torch.empty((1, wire.nbytes), dtype=torch.uint8, device=device)
        encode(wire_segments, wire, encoded)
        parts.append(encoded.view(-1))
    return torch.cat(parts)


def copy_out(rows: torch.Tensor, split_nbytes: Sequence[int], outputs: list[torch.Tensor]) -> None:
    """Scatter the rank-major all-gather output into each column's buffer.

    Args:
        rows: (W, sum of split_nbytes) uint8: the all-gather output, row r from rank r
            (or the exactly copied columns of it).
        split_nbytes: each column's bytes per rank, in order.
        outputs: where each column goes, as (W, its bytes) uint8 (a padded unsharded
            buffer, or an all-gather extension's output).
    """
    if outputs:
        torch.split_with_sizes_copy(rows, split_nbytes, dim=1, out=outputs)


def decode_columns(rows: torch.Tensor, wire: WireLayout, outputs: list[torch.Tensor]) -> None:
    """The encoded columns of the all-gather output ``rows`` ((W, wire.nbytes) uint8)
    decoded into ``outputs`` (each (W, padded shard numel) in param_dtype). Every rank
    decodes the same bytes, its own shard's too: identical weights everywhere."""
    decode(rows, wire, outputs)


def unsharded_of(padded_unsharded: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """The unsharded param (``shape``) in its padded unsharded buffer
    (``padded_unsharded_shape``): its first rows, a view (only ``Shard(0)`` pads)."""
    return padded_unsharded[: geometry.shape[0]]


def concat_along_shard_dim(
    rows: torch.Tensor, geometry: ShardGeometry, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """``rows`` (W, bytes): W padded shards of ``dtype`` back to back (a ``Shard(dim)``
    param's all-gather column) concatenated along the shard dim, into ``out``
    (``padded_unsharded_shape``) or a new tensor; returns it."""
    world_size, dim = geometry.world_size, geometry.dim
    chunks = rows.view(dtype).view(world_size, *geometry.padded_local_shape)
    if out is None:
        out = torch.empty(geometry.padded_unsharded_shape, dtype=dtype, device=rows.device)
    # (*shape[:dim], W, shape[dim] / W, *shape[dim + 1:]): concatenation along dim.
    out.view(geometry.padded_unsharded_shape).unflatten(dim, (world_size, -1)).copy_(
        chunks.movedim(0, dim)
    )
    return out


# Gradient reduction #


def arrange_for_reduce_scatter(grad: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """An unsharded grad (``shape``) arranged so that its dim-0 chunks are the ranks'
    shards: itself for ``Shard(0)``; for ``Shard(dim)`` (W, *shape[:dim], shape[dim] /
    W, *shape[dim + 1:]), a view."""
    if geometry.dim == 0:
        return grad
    return grad.unflatten(geometry.dim, (geometry.world_size, -1)).movedim(geometry.dim, 0)


def padded_chunk_numel(tensor: torch.Tensor, world_size: int) -> int:
    """Elements of one rank's padded dim-0 chunk of ``tensor`` (torch.chunk's size)."""
    return chunk_rows(tensor.shape[0], world_size) * math.prod(tensor.shape[1:])


def copy_in_grads(
    unsharded_grads: list[torch.Tensor], reduce_dtype: torch.dtype, world_size: int
) -> torch.Tensor:
    """One reduction input of the gradients, cast to ``reduce_dtype`` while they are
    copied in (torch's ``chunk_cat``): no per-gradient cast temporaries.

    Args:
        unsharded_grads: each arranged so that its dim-0 chunks are the ranks' shards
            (`arrange_for_reduce_scatter`), any float dtype.

    Returns:
        (W, sum of padded shard numels): row r holds rank r's padded chunk of every grad,
        the padding zero.
    """
    if len({g.dtype for g in unsharded_grads}) > 1:
        # `_chunk_cat` needs one input dtype. Mixed only after micro-batches without
        # sync under mixed precision: a param with a grad in an earlier micro-batch
        # brings its reduce_dtype accumulator, one first used in the last its
        # param_dtype grad (or zeros, reduce_scatter_unused_params). torch's FSDP2
        # refuses this case; casting the odd ones is exact (a widening cast).
        unsharded_grads = [g.to(reduce_dtype) for g in unsharded_grads]
    shard_numel = sum(padded_chunk_numel(g, world_size) for g in unsharded_grads)
    reduce_input = torch.empty(
        (world_size, shard_numel), dtype=reduce_dtype, device=unsharded_grads[0].device
    )
    torch._chunk_cat(unsharded_grads, dim=0, num_chunks=world_size, out=reduce_input)
    return reduce_input


def reduction_input(
    grads: list[torch.Tensor], reduce_dtype: torch.dtype, world_size: int, pre_divisor: float
) -> torch.Tensor:
    """The exact reduction's input: `copy_in_grads`, divided by ``pre_divisor`` in place
    (the same division of the same values as dividing each cast grad before the copy).
    Takes ``grads``: the list is emptied once they are copied in, so that the caller's
    are the last references and the grads are freed before the collective's output
    exists (torch frees them at the same point)."""
    reduce_input = copy_in_grads(grads, reduce_dtype, world_size)
    grads.clear()
    return divide_(reduce_input, pre_divisor)


def divide_(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    """``tensor`` divided by ``divisor`` in place (nothing for 1); returns it."""
    if divisor != 1.0:
        tensor.div_(divisor)
    return tensor


def sum_all_to_all(received: torch.Tensor) -> torch.Tensor:
    """This rank's reduced chunk of an all-to-all reduce-scatter: the sum over the rows
    of ``received`` ((W, n), row r from rank r), a fresh (n,) tensor (the sharded grads
    are views of it: a view of ``received`` would keep W times their size alive)."""
    return received.sum(dim=0)


def finish_reduced(
    reduced: torch.Tensor,
    post_divisor: float,
    divided_in_collective: bool,
    hook: Callable[[torch.Tensor], None] | None,
) -> torch.Tensor:
    """Divide ``reduced`` (1-D) in place once and run the user's all-reduce ``hook`` on
    it, in torch's order: torch divides inside the collective (AVG, PREMUL_SUM) for
    fp32/bf16 unless sums are forced, so the hook sees divided gradients then, and
    undivided ones otherwise. Returns ``reduced``."""
    if divided_in_collective:
        divide_(reduced, post_divisor)
    if hook is not None:
        hook(reduced)
    if not divided_in_collective:
        divide_(reduced, post_divisor)
    return reduced


def sharded_grads(reduced: torch.Tensor, geometries: Sequence[ShardGeometry]) -> list[torch.Tensor]:
    """Each param's sharded gradient (``local_shape``), views of ``reduced`` ((sum of
    padded chunk numels,), the params' padded chunks in order): the padding dropped."""
    pieces = reduced.split([g.padded_shard_numel for g in geometries])
    return [
        piece[: geometry.local_numel].view(geometry.local_shape)
        for piece, geometry in zip(pieces, geometries, strict=True)
    ]


# Quantized reduce-scatter (CommPrecisionPolicy.reduce_scatter) #


@dataclass(frozen=True)
class QuantizedRows:
    """How a quantized reduce-scatter's rows are laid out: the exact chunks as
    ``reduce_dtype`` bytes, then the encoded ones."""

    exact_numels: list[int]  # per exact grad, its chunk's elements (in the row's order)
    wire: WireLayout
    is_quantized: list[bool]  # per grad in the caller's order
    reduce_dtype: torch.dtype

    @property
    def exact_nbytes(self) -> int:
        return sum(self.exact_numels) * self.reduce_dtype.itemsize


def quantized_send_rows(
    unsharded_grads: list[torch.Tensor],
    is_quantized: Sequence[bool],
    reduce_dtype: torch.dtype,
    pre_divisor: float,
    world_size: int,
    fmt: str,
    block_size: int,
    residuals: list[torch.Tensor | None] | None,
) -> tuple[torch.Tensor, QuantizedRows]:
    """What a quantized reduce-scatter's all-to-all sends: row r ((W, bytes) uint8)
    carries rank r's chunk of every grad (cast to ``reduce_dtype``, divided by
    ``pre_divisor``), the exact ones as ``reduce_dtype`` bytes, the quantized ones
    block-wise encoded. Takes ``unsharded_grads`` as `reduction_input` does.

    Args:
        unsharded_grads: each arranged for the reduce-scatter.
        is_quantized: per grad, whether it travels encoded.
        residuals: error feedback (or None): per grad, None or its (W, chunk numel) fp32
            quantization error from the last step, added before encoding and replaced in
            place by this step's.
    """
    grads = [grad.to(reduce_dtype) for grad in unsharded_grads]
    unsharded_grads.clear()
    if pre_divisor != 1.0:
        grads = torch._foreach_div(grads, pre_divisor)
    device = grads[0].device
    exact = [g for g, q in zip(grads, is_quantized, strict=True) if not q]
    exact_numels = [padded_chunk_numel(g, world_size) for g in exact]
    chunks = []  # per quantized grad, (W, padded chunk numel): row r is rank r's chunk
    for grad, quantized in zip(grads, is_quantized, strict=True):
        if quantized:
            rows = torch.empty(
                (world_size, padded_chunk_numel(grad, world_size)), dtype=grad.dtype, device=device
            )
            torch._chunk_cat([grad], dim=0, num_chunks=world_size, out=rows)
            chunks.append(rows)
    wire = WireLayout(fmt, block_size, tuple(c.shape[1] for c in chunks))
    layout = QuantizedRows(exact_numels, wire, list(is_quantized), reduce_dtype)
    exact_nbytes = layout.exact_nbytes
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
        _update_residuals(send[:, exact_nbytes:], wire, chunks, residual_list)
    return send, layout


def _update_residuals(
    encoded: torch.Tensor,
    wire: WireLayout,
    sent: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
) -> None:
    """Error feedback: each residual becomes what encoding dropped of its ``sent``."""
    decoded = [torch.empty_like(c) for c in sent]
    decode(encoded, wire, decoded)
    for residual, chunk, values in zip(residuals, sent, decoded, strict=True):
        if residual is not None:
            torch.sub(chunk, values, out=residual)
            # A non-finite block decodes to NaN/inf: carrying that into every later
            # step would poison the block for good (one skipped fp16 step would make
            # GradScaler skip forever). Its error is dropped instead.
            residual.masked_fill_(~torch.isfinite(residual), 0.0)


def sum_quantized_rows(received: torch.Tensor, layout: QuantizedRows) -> torch.Tensor:
    """This rank's summed chunk of every grad, (sum of padded chunk numels,) in
    ``reduce_dtype``, in the grads' order, from the all-to-all's ``received`` rows.
    Exact chunks are summed in ``reduce_dtype`` as the exact path does; quantized ones
    in fp32 after decoding."""
    exact_nbytes = layout.exact_nbytes
    # (W, exact elements): contiguous first, the row stride may not fit the dtype's size.
    exact_sum = received[:, :exact_nbytes].contiguous().view(layout.reduce_dtype).sum(dim=0)
    exact_iter = iter(exact_sum.split(layout.exact_numels))
    quantized_iter = iter(decode_sum(received[:, exact_nbytes:], layout.wire))
    parts = [
        next(quantized_iter) if quantized else next(exact_iter) for quantized in layout.is_quantized
    ]
    return torch.cat([p.to(layout.reduce_dtype) for p in parts])


# Quantized all-reduce (HSDP's replicate leg, ZeRO++'s qgZ) #


@dataclass(frozen=True)
class QuantizedSums:
    """How a quantized all-reduce lays its inputs out: each starts on a block boundary
    and each rank's chunk is whole blocks, so no block mixes two parameters (a small
    gradient keeps its own scale, as on the other legs)."""

    wire: WireLayout  # one segment: one rank's chunk of whole blocks
    offsets: list[int]  # where each input starts in the padded (R * chunk,) buffer
    numels: list[int]
    dtypes: list[torch.dtype]


def quantized_sum_rows(
    tensors: list[torch.Tensor], size: int, fmt: str, block_size: int
) -> tuple[torch.Tensor, QuantizedSums]:
    """The all-to-all rows ((R, wire bytes) uint8, row r for rank r) that start the
    quantized sum of ``tensors`` (1-D each) over ``size`` ranks: row r carries the
    encoded chunk r of the inputs laid out back to back."""
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
    layout = QuantizedSums(wire, offsets, [t.numel() for t in tensors], [t.dtype for t in tensors])
    return send, layout


def encoded_partial_sum(received: torch.Tensor, layout: QuantizedSums) -> torch.Tensor:
    """This rank's chunk summed over the ranks (fp32, after decoding ``received``,
    (R, wire bytes)), encoded again: the all-gather's input, (wire bytes,) uint8."""
    (chunk,) = layout.wire.numels
    (my_sum,) = decode_sum(received, layout.wire)  # (chunk,) fp32
    mine = torch.empty((1, layout.wire.nbytes), dtype=torch.uint8, device=received.device)
    encode([my_sum.view(1, chunk)], layout.wire, mine)
    return mine.view(-1)


def decoded_sums(gathered: torch.Tensor, layout: QuantizedSums) -> list[torch.Tensor]:
    """Each input's sum over the ranks, in its dtype, from the all-gathered encoded
    sums ``gathered`` ((R * wire bytes,) uint8)."""
    (chunk,) = layout.wire.numels
    rows = gathered.view(-1, layout.wire.nbytes)  # (R, wire bytes)
    total = torch.empty((rows.shape[0], chunk), dtype=torch.float32, device=gathered.device)
    decode(rows, layout.wire, [total])
    flat = total.view(-1)  # (R * chunk,)
    return [
        flat[offset : offset + numel].to(dtype)
        for offset, numel, dtype in zip(layout.offsets, layout.numels, layout.dtypes, strict=True)
    ]


# HSDP's replicate leg #


def replica_input(chunk: torch.Tensor | None, partial: torch.Tensor | None) -> torch.Tensor:
    """What a param contributes to the all-reduce over replicas: its shard-reduced
    ``chunk`` plus the partial sum that micro-batches without all-reduce left (in that
    order: ``partial + chunk``, as the sum grew)."""
    if partial is None:
        assert chunk is not None
        return chunk
    return partial if chunk is None else partial + chunk


def split_replica_parts(
    parts: Sequence[torch.Tensor], is_quantized: Sequence[bool]
) -> tuple[torch.Tensor | None, list[int], list[torch.Tensor]]:
    """The all-reduce's inputs: the exact parts concatenated (None if none), their
    numels, and the quantized parts (each 1-D), as `merge_replica_sums` takes them."""
    exact = [t for t, q in zip(parts, is_quantized, strict=True) if not q]
    quantized = [t for t, q in zip(parts, is_quantized, strict=True) if q]
    exact_flat = torch.cat(exact) if exact else None  # (exact padded chunk numels,)
    return exact_flat, [t.numel() for t in exact], quantized


def merge_replica_sums(
    exact: torch.Tensor | None,
    exact_numels: Sequence[int],
    quantized: Sequence[torch.Tensor],
    is_quantized: Sequence[bool],
) -> torch.Tensor:
    """The params' reduced chunks, one 1-D buffer in their order, from the exact ones'
    all-reduced concatenation ``exact`` and the quantized ones' sums."""
    exact_iter = iter(exact.split(list(exact_numels)) if exact is not None else ())
    quantized_iter = iter(quantized)
    return torch.cat([next(quantized_iter) if q else next(exact_iter) for q in is_quantized])
