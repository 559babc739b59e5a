"""Wire format for quantized FSDP communication (ZeRO++-style qwZ / qgZ).

A stateless codec: it turns float tensors into the bytes one rank sends and turns received
bytes back into float tensors. It knows nothing about process groups; the all-gather
(weights, qwZ) and reduce-scatter (gradients, qgZ) paths call it around their collectives.

Rows and segments
-----------------
A *row* is what one rank contributes to a collective: a ``(nbytes,)`` uint8 run. A row
carries a list of *segments*, 1-D runs of ``n_i`` float elements encoded back to back (for
an all-gather, each parameter's padded shard; for a reduce-scatter, each parameter's
gradient chunk destined for one rank). The codec works on ``rows`` rows at once: a segment
is passed as a ``(rows, n_i)`` tensor and the wire buffer is ``(rows, nbytes)`` uint8.
:class:`WireLayout` fixes the format, the block size and the ``n_i``; every rank builds the
same layout, so the receiver knows where each segment lies without any header.

Formats
-------
``"bf16"``
    The segments cast to bfloat16, back to back, 2 bytes per element, no scales::

        nbytes = 2 * sum_i n_i

``"int8"`` and ``"fp8_e4m3"`` (``torch.float8_e4m3fn``)
    Each segment is split into blocks of ``block_size`` elements; the last block of a
    segment may be partial. Blocks never cross a segment boundary, so a small tensor next
    to a big one keeps its own scale. A row holds the codes first, then the scales::

        | seg 0 codes, padded | seg 1 codes, padded | ... | scale 0 | scale 1 | ... |
          ceil(n_0/bs)*bs B     ceil(n_1/bs)*bs B           one float32 per block,
                                                             all segments' blocks in order

        nbytes = sum_i ceil(n_i/bs)*bs  +  4 * sum_i ceil(n_i/bs)

    A partial last block is padded with zero codes. Scales are stored in the device's native
    byte order (little-endian on every device torch targets). ``block_size`` is a multiple of 4, so
    the codes region ends 4-byte aligned relative to the row start and the scales follow
    without a gap. The scales travel in the same buffer as the codes: one collective per
    buffer, no second, tiny one whose latency would dominate.

    Per block (all arithmetic in float32 whatever the input dtype)::

        int8:      scale = absmax / 127;  code = clamp(round(x / scale), -127, 127)
        fp8_e4m3:  scale = absmax / 448;  code = float8_e4m3fn(clamp(x / scale, -448, 448))
        decoded value = float32(code) * scale

    ``round`` is ``torch.round`` (half to even). int8 is symmetric: -128 is never used, so
    negating a block negates its codes. An all-zero block gets scale 0 and zero codes (no
    division by zero, no NaN) and decodes to zeros.

Error bounds (per element, up to float32 rounding): int8 ``|x - x_hat| <= absmax_block / 254``
(half a quantization step); fp8_e4m3 relative error ``<= 2**-4`` where ``|x| / scale >= 2**-6``
(a normal e4m3 number has 3 mantissa bits) and absolute error ``<= scale * 2**-10`` below
(half the e4m3 subnormal step); bf16 relative error ``<= 2**-8``.

Non-finite values
-----------------
Overflow detection (``torch.amp.GradScaler``) must still see an inf/NaN after a quantized
reduce-scatter. A block that contains an inf or NaN has absmax inf or NaN, so its scale is
non-finite, and every element of that block decodes to NaN or +-inf (``code * inf`` is
+-inf or, for a zero code, NaN; ``code * nan`` is NaN). Other blocks are unaffected. In
``"bf16"`` an inf/NaN element simply stays inf/NaN.

Determinism
-----------
Encoding is a fixed sequence of elementwise ops and per-block max reductions (exact), so
the same input always gives the same bytes, and every byte of the row, padding included,
is written. FSDP relies on it: every rank dequantizes the same gathered bytes, its own shard
included, so all ranks compute with identical weights.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

WireFormat = Literal["bf16", "int8", "fp8_e4m3"]

WIRE_FORMATS: tuple[str, ...] = ("bf16", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class _QuantSpec:
    """How one quantized format maps a scaled float32 to a one-byte code."""

    code_dtype: torch.dtype
    # Largest code magnitude: the block's absmax maps to it.
    qmax: float
    # int8 needs an explicit round (a float -> int cast truncates); the fp8 cast rounds itself.
    rounds: bool


_QUANT_SPECS: dict[str, _QuantSpec] = {
    "int8": _QuantSpec(torch.int8, 127.0, rounds=True),
    "fp8_e4m3": _QuantSpec(torch.float8_e4m3fn, 448.0, rounds=False),
}


@dataclass(frozen=True)
class WireLayout:
    """One row's layout: the format, the block size and the segments' element counts.

    Args:
        fmt: ``"bf16"``, ``"int8"`` or ``"fp8_e4m3"``.
        block_size: elements per quantization block. A positive multiple of 4 (keeps the
            scales 4-byte aligned within a row). Validated for every format so that a bad
            value fails at once, but it does not change the ``"bf16"`` layout.
        numels: each segment's element count ``n_i`` (0 allowed), in wire order.

    Raises:
        ValueError: ``fmt`` is not a known format, ``block_size`` is not a positive
            multiple of 4, or a count is negative.
    """

    fmt: WireFormat
    block_size: int
    numels: tuple[int, ...]
    # Derived once, at construction (graph mode traces the codec, and dynamo cannot
    # trace functools.cached_property's lock): ``ceil(n_i / block_size)`` per segment
    # (0 for bf16: it has no blocks), the elements each segment occupies on the wire
    # (``n_i`` rounded up to whole blocks), and each segment's element offset within a
    # row's padded payload.
    blocks_per_segment: tuple[int, ...] = field(init=False, repr=False, compare=False)
    padded_numels: tuple[int, ...] = field(init=False, repr=False, compare=False)
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fmt not in WIRE_FORMATS:
            raise ValueError(
                f"WireLayout: fmt must be one of {', '.join(map(repr, WIRE_FORMATS))}, "
                f"got {self.fmt!r}"
            )
        block_size = self.block_size
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size <= 0
            or block_size % 4
        ):
            raise ValueError(
                "WireLayout: block_size must be a positive int multiple of 4 (e.g. 32, 64, "
                f"128, 256) so the float32 scales stay 4-byte aligned, got {block_size!r}"
            )
        numels = tuple(self.numels)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numels):
            raise ValueError(f"WireLayout: numels must be non-negative ints, got {self.numels!r}")
        # Accept any sequence; store a tuple so the layout stays hashable.
        object.__setattr__(self, "numels", numels)
        if self.fmt == "bf16":
            blocks, padded = tuple(0 for _ in numels), numels
        else:
            blocks = tuple(math.ceil(n / block_size) for n in numels)
            padded = tuple(b * block_size for b in blocks)
        object.__setattr__(self, "blocks_per_segment", blocks)
        object.__setattr__(self, "padded_numels", padded)
        object.__setattr__(self, "offsets", tuple(_exclusive_cumsum(padded)))

    @property
    def is_quantized(self) -> bool:
        return self.fmt != "bf16"

    @property
    def num_blocks(self) -> int:
        """Blocks in one row, i.e. float32 scales in one row."""
        return sum(self.blocks_per_segment)

    @property
    def padded_numel(self) -> int:
        """Elements in a row's payload, padding included."""
        return sum(self.padded_numels)

    @property
    def codes_nbytes(self) -> int:
        """Bytes of the payload region: one-byte codes, or two-byte bf16 values."""
        return self.padded_numel * (2 if self.fmt == "bf16" else 1)

    @property
    def scales_nbytes(self) -> int:
        return 4 * self.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes per row: ``codes_nbytes + scales_nbytes``."""
        return self.codes_nbytes + self.scales_nbytes


def encode(segments: Sequence[torch.Tensor], layout: WireLayout, out: torch.Tensor) -> None:
    """Encode ``rows`` rows of segments into ``out``.

    Args:
        segments: one ``(rows, n_i)`` tensor per ``layout.numels`` entry, any floating
            dtype, possibly non-contiguous views. Must not overlap ``out``.
        layout: the row layout.
        out: ``(rows, layout.nbytes)`` uint8, possibly a non-contiguous view into a bigger
            buffer (row stride != nbytes) at any byte offset; no alignment is assumed.
            Every byte of it is written; nothing outside it is.

    Raises:
        ValueError: the segments or ``out`` do not match ``layout``.
    """
    rows = _check_wire(out, layout, "encode", "out")
    _check_segments(segments, layout, rows, "encode", "segments")
    if not layout.is_quantized:
        _encode_bf16(segments, layout, out)
        return
    spec = _QUANT_SPECS[layout.fmt]
    # One padded float32 staging buffer: zeros fill every partial block's tail, so padding
    # encodes as zero codes and does not raise a block's absmax.
    staged = torch.zeros(rows, layout.padded_numel, dtype=torch.float32, device=out.device)
    for segment, offset in zip(segments, layout.offsets, strict=True):
        if segment.shape[1]:
            staged[:, offset : offset + segment.shape[1]].copy_(segment)  # (rows, n_i)
    blocks = staged.view(rows, layout.num_blocks, layout.block_size)  # (rows, nb, bs)
    # The inf-norm is the absmax in one reduction without a full-size abs() temporary; it
    # propagates NaN and gives inf for +-inf, which the non-finite guarantee relies on.
    absmax = torch.linalg.vector_norm(blocks, ord=math.inf, dim=-1)  # (rows, nb)
    scales = absmax.div_(spec.qmax)  # (rows, nb) float32
    # An all-zero block divides by 1 instead of 0: its codes are 0 and its scale stays 0.
    divisors = scales.masked_fill(scales == 0, 1.0)  # (rows, nb)
    blocks.div_(divisors.unsqueeze(-1))  # (rows, nb, bs), in place: the staging is ours
    if spec.rounds:
        # A non-finite block (scale inf/NaN) leaves NaN quotients; casting NaN to int8 is
        # undefined, so pin them to 0. The block still decodes non-finite via its scale.
        blocks.round_().clamp_(-spec.qmax, spec.qmax).nan_to_num_(nan=0.0)
    else:
        # e4m3fn has no inf: clamp so a rounding overshoot past 448 cannot become NaN.
        blocks.clamp_(-spec.qmax, spec.qmax)
    # Same-size dtype views work at any byte offset, so the cast writes straight into out.
    codes = out[:, : layout.codes_nbytes].view(spec.code_dtype)  # (rows, padded_numel)
    codes.copy_(staged)
    # The byte view of the (aligned) scales copies into out whatever out's alignment is.
    out[:, layout.codes_nbytes :].copy_(scales.view(torch.uint8))  # (rows, 4 * nb)


def decode(wire: torch.Tensor, layout: WireLayout, outs: Sequence[torch.Tensor]) -> None:
    """Decode ``rows`` rows of ``wire`` into ``outs``.

    Args:
        wire: ``(rows, layout.nbytes)`` uint8, possibly a view at any byte offset.
        layout: the row layout the bytes were encoded with.
        outs: one ``(rows, n_i)`` tensor per segment, any floating dtype, possibly
            non-contiguous views (e.g. the unsharded parameters' rows). Filled with the
            dequantized values, computed in float32 and cast to their dtype.

    Raises:
        ValueError: ``wire`` or ``outs`` do not match ``layout``.
    """
    rows = _check_wire(wire, layout, "decode", "wire")
    _check_segments(outs, layout, rows, "decode", "outs")
    if layout.is_quantized:
        values = _dequantize(wire, layout)  # (rows, padded_numel) float32
    else:
        values = _read_as(wire, torch.bfloat16)  # (rows, sum n_i) bfloat16
    for target, offset in zip(outs, layout.offsets, strict=True):
        if target.shape[1]:
            target.copy_(values[:, offset : offset + target.shape[1]])  # (rows, n_i)


def decode_sum(wire: torch.Tensor, layout: WireLayout) -> list[torch.Tensor]:
    """Dequantize every row of ``wire`` and sum over the rows, in float32.

    For the reduce-scatter: row ``r`` is rank ``r``'s encoding of this rank's chunk.

    Args:
        wire: ``(W, layout.nbytes)`` uint8, possibly a view at any byte offset.
        layout: the row layout the bytes were encoded with.

    Returns:
        One ``(n_i,)`` float32 tensor per segment: the sum over the ``W`` rows of the
        dequantized values. The sum is done in float32 for every format, bf16 included:
        accumulating in a low precision would lose the small contributions.
        The tensors are views of one buffer.

    Raises:
        ValueError: ``wire`` does not match ``layout``.
    """
    _check_wire(wire, layout, "decode_sum", "wire")
    if layout.is_quantized:
        values = _dequantize(wire, layout)  # (W, padded_numel) float32
    else:
        values = _read_as(wire, torch.bfloat16).to(torch.float32)  # (W, sum n_i)
    total = values.sum(dim=0)  # (padded_numel,) float32
    return [
        total[o : o + n] for o, n in zip(layout.offsets, layout.numels, strict=True)
    ]  # each (n_i,)


def quantization_error(x: torch.Tensor, fmt: WireFormat, block_size: int) -> float:
    """Relative L2 error ``||x - decode(encode(x))|| / ||x||`` of one tensor's round trip.

    For choosing a block size: smaller blocks track local magnitudes better but spend
    ``4 / block_size`` bytes per element on scales.

    Args:
        x: any floating tensor; flattened into one segment of one row.
        fmt: the wire format.
        block_size: elements per block (see :class:`WireLayout`).

    Returns:
        The relative error (0.0 for an all-zero or empty ``x``; NaN if ``x`` has an inf/NaN).
    """
    layout = WireLayout(fmt, block_size, (x.numel(),))
    flat = x.detach().reshape(1, -1)  # (1, numel)
    wire = torch.empty(1, layout.nbytes, dtype=torch.uint8, device=x.device)
    encode([flat], layout, wire)
    decoded = torch.empty(flat.shape, dtype=torch.float32, device=x.device)  # (1, numel)
    decode(wire, layout, [decoded])
    reference = flat.to(torch.float64)
    norm = torch.linalg.vector_norm(reference).item()
    if norm == 0.0:
        return 0.0
    return torch.linalg.vector_norm(decoded.to(torch.float64) - reference).item() / norm


# Helpers #


def _exclusive_cumsum(values: Sequence[int]) -> list[int]:
    offsets, running = [], 0
    for value in values:
        offsets.append(running)
        running += value
    return offsets


def _encode_bf16(segments: Sequence[torch.Tensor], layout: WireLayout, out: torch.Tensor) -> None:
    """Write the segments as bf16; straight into ``out`` when it can be viewed as bf16."""
    rows = out.shape[0]
    target = _try_view(out, torch.bfloat16)  # (rows, sum n_i) or None
    staged = (
        target
        if target is not None
        else torch.empty(rows, layout.padded_numel, dtype=torch.bfloat16, device=out.device)
    )
    for segment, offset in zip(segments, layout.offsets, strict=True):
        if segment.shape[1]:
            staged[:, offset : offset + segment.shape[1]].copy_(segment)  # (rows, n_i)
    if target is None:
        # out is misaligned for bf16: copy the staged values' bytes instead.
        out.copy_(staged.view(torch.uint8))  # (rows, 2 * sum n_i)


def _dequantize(wire: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """``(rows, nbytes)`` quantized wire -> ``(rows, padded_numel)`` float32 values."""
    spec = _QUANT_SPECS[layout.fmt]
    rows = wire.shape[0]
    codes = wire[:, : layout.codes_nbytes].view(spec.code_dtype)  # (rows, padded_numel)
    codes = codes.view(rows, layout.num_blocks, layout.block_size)  # (rows, nb, bs)
    scales = _read_as(wire[:, layout.codes_nbytes :], torch.float32)  # (rows, nb)
    values = codes.to(torch.float32).mul_(scales.unsqueeze(-1))  # (rows, nb, bs)
    return values.view(rows, layout.padded_numel)


def _try_view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """View ``(rows, k * itemsize)`` uint8 as ``(rows, k)`` ``dtype`` if aligned, else None.

    Reinterpreting bytes as a wider dtype needs the address and every row stride to be
    multiples of its size; a view into a shared wire buffer at an odd offset is not.
    Inside a compiled graph (graph mode) the address is not known while tracing: the
    callers copy (the same values).
    """
    if torch.compiler.is_compiling():
        return None
    itemsize = dtype.itemsize
    aligned = (
        raw.stride(-1) == 1
        and raw.stride(0) % itemsize == 0
        and raw.storage_offset() % itemsize == 0
        and raw.data_ptr() % itemsize == 0
    )
    return raw.view(dtype) if aligned else None


def _read_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(rows, k * itemsize)`` uint8 -> ``(rows, k)`` ``dtype``, via an aligned copy if needed."""
    view = _try_view(raw, dtype)
    if view is not None:
        return view
    aligned = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw)
    return aligned.view(dtype)


def _check_wire(wire: torch.Tensor, layout: WireLayout, fn: str, name: str) -> int:
    """Validate a ``(rows, nbytes)`` uint8 wire tensor; return ``rows``."""
    if wire.dtype != torch.uint8 or wire.dim() != 2 or wire.shape[1] != layout.nbytes:
        raise ValueError(
            f"{fn}: {name} must be a (rows, {layout.nbytes}) uint8 tensor for {layout}, "
            f"got {tuple(wire.shape)} {wire.dtype}"
        )
    return wire.shape[0]


def _check_segments(
    tensors: Sequence[torch.Tensor], layout: WireLayout, rows: int, fn: str, name: str
) -> None:
    if len(tensors) != len(layout.numels):
        raise ValueError(
            f"{fn}: expected {len(layout.numels)} {name} (one per layout.numels entry), "
            f"got {len(tensors)}"
        )
    for i, (tensor, numel) in enumerate(zip(tensors, layout.numels, strict=True)):
        if tuple(tensor.shape) != (rows, numel) or not tensor.is_floating_point():
            raise ValueError(
                f"{fn}: {name}[{i}] must be a floating ({rows}, {numel}) tensor, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
