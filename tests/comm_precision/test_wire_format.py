"""The quantized wire codec: byte layout, round trips, error bounds, non-finite values.

The codec is a pure function of its inputs with no torch counterpart, so the reference
here is a literal, one-block-at-a-time encoder written from the format description in
``dtensor_fsdp/comm_precision/wire_format.py``; bounds come from the formats' numerics.
"""

import math

import pytest
import torch

from dtensor_fsdp.comm_precision.wire_format import (
    WIRE_FORMATS,
    WireLayout,
    decode,
    decode_sum,
    encode,
    quantization_error,
)

QUANT_FORMATS = ("int8", "fp8_e4m3")
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
# Layouts with partial last blocks, segments smaller than one block and empty segments.
NUMELS = [(5, 2, 0, 3), (64,), (1,), (0, 0), (37, 8, 100), ()]


def _encoded(segments: list[torch.Tensor], layout: WireLayout) -> torch.Tensor:
    wire = torch.empty(segments[0].shape[0] if segments else 1, layout.nbytes, dtype=torch.uint8)
    encode(segments, layout, wire)
    return wire  # (rows, nbytes)


def _decoded(wire: torch.Tensor, layout: WireLayout, dtype=torch.float32) -> list[torch.Tensor]:
    outs = [torch.empty(wire.shape[0], n, dtype=dtype) for n in layout.numels]
    decode(wire, layout, outs)
    return outs  # each (rows, n_i)


def _random_segments(numels, rows=2, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, n, generator=gen).to(dtype) for n in numels]


def _reference_row(row_segments: list[torch.Tensor], fmt: str, block_size: int) -> torch.Tensor:
    """One row's bytes, built block by block straight from the format description."""
    if fmt == "bf16":
        parts = [
            s.to(torch.bfloat16).clone(memory_format=torch.contiguous_format).view(torch.uint8)
            for s in row_segments
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    codes, scales = [], []
    for segment in row_segments:
        x = segment.to(torch.float32)  # (n_i,)
        for start in range(0, x.numel(), block_size):
            block = x[start : start + block_size]
            scale = block.abs().max() / QMAX[fmt]
            q = block / scale if scale != 0 else torch.zeros_like(block)
            if fmt == "int8":
                q = q.round().clamp(-127, 127)
            else:
                q = q.clamp(-448, 448)
            padded = torch.zeros(block_size, dtype=torch.float32)
            padded[: block.numel()] = q
            codes.append(padded.to(code_dtype).view(torch.uint8))
            scales.append(scale.reshape(1))
    if not codes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([*codes, torch.cat(scales).view(torch.uint8)])


# Layout #


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("numels", NUMELS)
def test_nbytes_formula(fmt: str, block_size: int, numels: tuple[int, ...]) -> None:
    layout = WireLayout(fmt, block_size, numels)
    if fmt == "bf16":
        assert layout.nbytes == 2 * sum(numels) and layout.num_blocks == 0
    else:
        blocks = sum(math.ceil(n / block_size) for n in numels)
        assert layout.num_blocks == blocks
        assert layout.codes_nbytes == blocks * block_size
        assert layout.nbytes == blocks * block_size + 4 * blocks


def test_int8_bytes_by_hand() -> None:
    # block_size 4, segments of 5, 2, 0, 3 elements: blocks 2 + 1 + 0 + 1 = 4,
    # codes 8 + 4 + 0 + 4 = 16 bytes, then 4 float32 scales = 16 bytes.
    layout = WireLayout("int8", 4, [5, 2, 0, 3])
    assert layout.numels == (5, 2, 0, 3) and layout.nbytes == 32
    segments = [
        torch.tensor([[254.0, -128.0, 2.0, 0.0, 4.0]]),  # scales 2, 4/127
        torch.tensor([[0.0, 0.0]]),  # all-zero block: scale 0, zero codes
        torch.empty(1, 0),
        torch.tensor([[-1.0, 0.5, 0.25]]),  # scale 1/127
    ]
    wire = _encoded(segments, layout)[0]
    expected_codes = [127, -64, 1, 0, 127, 0, 0, 0, 0, 0, 0, 0, -127, 64, 32, 0]
    assert wire[:16].view(torch.int8).tolist() == expected_codes
    expected_scales = torch.tensor([254.0, 4.0, 0.0, 1.0]) / 127  # float32, in block order
    assert torch.equal(wire[16:].clone().view(torch.float32), expected_scales)


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("numels", NUMELS)
def test_bytes_match_reference(fmt: str, numels: tuple[int, ...]) -> None:
    layout = WireLayout(fmt, 8, numels)
    rows = 3
    # Non-contiguous inputs: transposed (n_i, rows) tensors, with a range of magnitudes.
    segments = [torch.randn(n, rows).mul(10.0 ** (i - 2)).T for i, n in enumerate(numels)]
    wire = torch.empty(rows, layout.nbytes, dtype=torch.uint8)
    encode(segments, layout, wire)
    for r in range(rows):
        expected = _reference_row([s[r] for s in segments], fmt, 8)
        assert torch.equal(wire[r], expected), f"row {r}"


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("col_offset", [3, 4])  # 3: misaligned for bf16/float32 views
def test_out_view_inside_bigger_buffer(fmt: str, col_offset: int) -> None:
    layout = WireLayout(fmt, 8, (13, 3, 0, 20))
    rows = 2
    segments = _random_segments(layout.numels, rows)
    expected = _encoded(segments, layout)
    # Row stride nbytes + 10 != nbytes; byte offset cols + col_offset (odd for col_offset 3).
    cols = layout.nbytes + 10
    big = torch.full((rows + 2, cols), 0xAB, dtype=torch.uint8)
    out = big[1 : 1 + rows, col_offset : col_offset + layout.nbytes]  # (rows, nbytes)
    assert out.stride(0) != layout.nbytes
    encode(segments, layout, out)
    assert torch.equal(out, expected)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[1 : 1 + rows, col_offset : col_offset + layout.nbytes] = False
    assert bool((big[untouched] == 0xAB).all())
    # Decoding from the misaligned view agrees with decoding the contiguous bytes, and
    # writes into non-contiguous outputs (columns of bigger tensors).
    outs = [torch.zeros(n + 1, rows)[1:].T for n in layout.numels]  # each (rows, n_i)
    decode(out, layout, outs)
    for got, want in zip(outs, _decoded(expected, layout)):
        assert torch.equal(got, want)
    for got, want in zip(decode_sum(out, layout), decode_sum(expected, layout)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_encode_is_deterministic_and_writes_every_byte(fmt: str, fill: int) -> None:
    # Same input -> same bytes, whatever out held before (padding codes included): every
    # rank must decode identical weights from the gathered bytes.
    layout = WireLayout(fmt, 16, (7, 33))
    segments = _random_segments(layout.numels)
    first = torch.full((2, layout.nbytes), fill, dtype=torch.uint8)
    encode(segments, layout, first)
    assert torch.equal(first, _encoded(segments, layout))


# Round trips #


def _exact_values(fmt: str, numels, rows: int, block_size: int, seed: int) -> list[torch.Tensor]:
    """Values the format represents exactly, with a different power-of-two scale per block."""
    gen = torch.Generator().manual_seed(seed)
    segments = []
    for n in numels:
        if fmt == "int8":
            # Integers in [-127, 127], each block holding a +-127: scale = 127 * 2^e / 127 = 2^e.
            base = torch.randint(-127, 128, (rows, n), generator=gen).float()
            top = 127.0
        elif fmt == "fp8_e4m3":
            # Random finite e4m3 numbers (bytes 0x7F / 0xFF are NaN), absmax 448 per block.
            raw = torch.randint(0, 256, (rows, n), generator=gen, dtype=torch.uint8)
            base = raw.view(torch.float8_e4m3fn).float().nan_to_num(0.0)
            top = 448.0
        else:
            base = torch.randn(rows, n, generator=gen).bfloat16().float()
            top = None
        if top is not None:
            base[:, ::block_size] = top * torch.where(base[:, ::block_size] < 0, -1.0, 1.0)
            # One exponent per block in [-4, 4]: keeps 448 * 2^4 inside fp16's range.
            exps = torch.randint(-4, 5, (rows, math.ceil(n / block_size)), generator=gen)
            base = base * torch.exp2(exps.float()).repeat_interleave(block_size, dim=1)[:, :n]
        segments.append(base)
    return segments


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 32])
def test_exact_round_trip(fmt: str, in_dtype, out_dtype, block_size: int) -> None:
    numels = (5, 70, 0, 3)
    values = _exact_values(fmt, numels, rows=2, block_size=block_size, seed=block_size)
    if fmt == "bf16" and in_dtype == torch.float16:
        # Random bf16 numbers are not fp16 numbers; small multiples of 2^-6 are both.
        values = [torch.round(v * 64) / 64 for v in values]
    # Every value is exact in every in/out dtype here (<= 8 significant bits, in range),
    # so the casts lose nothing and any difference is the codec's.
    assert all(torch.equal(v.to(in_dtype).float(), v) for v in values)
    assert all(torch.equal(v.to(out_dtype).float(), v) for v in values)
    layout = WireLayout(fmt, block_size, numels)
    wire = _encoded([v.to(in_dtype) for v in values], layout)
    for got, want in zip(_decoded(wire, layout, out_dtype), values):
        assert got.dtype == out_dtype
        assert torch.equal(got.float(), want)


def _wide_range(numels, rows: int, block_size: int, in_dtype) -> list[torch.Tensor]:
    """Random values whose magnitude changes by up to 10^12 from one block to the next."""
    gen = torch.Generator().manual_seed(1)
    segments = []
    for n in numels:
        blocks = math.ceil(n / block_size)
        magnitude = 10.0 ** torch.empty(rows, blocks).uniform_(-6, 6, generator=gen)
        scale = magnitude.repeat_interleave(block_size, dim=1)[:, :n]
        segments.append((torch.randn(rows, n, generator=gen) * scale).to(in_dtype))
    return segments


def _block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(rows, n) -> (rows, n): each element's block absmax (blocks restart per segment)."""
    rows, n = x.shape
    padded = torch.zeros(rows, math.ceil(n / block_size) * block_size)
    padded[:, :n] = x.abs()
    absmax = padded.view(rows, -1, block_size).amax(dim=-1)  # (rows, blocks)
    return absmax.repeat_interleave(block_size, dim=1)[:, :n]


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 64])
def test_error_bounds(fmt: str, in_dtype, block_size: int) -> None:
    numels = (300, 7, 129)
    segments = _wide_range(numels, rows=2, block_size=block_size, in_dtype=in_dtype)
    layout = WireLayout(fmt, block_size, numels)
    decoded = _decoded(_encoded(segments, layout), layout)
    for segment, got in zip(segments, decoded):
        x = segment.float()
        err = (got - x).abs()
        # The bounds are per block: with one scale per tensor the 10^-6 blocks would
        # round to zero, far outside them.
        absmax = _block_absmax(x, block_size)
        if fmt == "int8":
            # Half a step, scale / 2 = absmax / 254, plus float32 rounding of x / scale,
            # of the scale and of code * scale (each <= 2^-24 relative, ~absmax * 2^-24).
            bound = absmax / 254 + absmax * 2.0**-22
        elif fmt == "fp8_e4m3":
            scale = absmax / 448  # the codec's float32 scale, computed the same way
            scaled = (x / scale).abs()
            # Normal e4m3 (>= 2^-6): 3 mantissa bits, round to nearest -> relative 2^-4.
            # Below: subnormal step 2^-9 -> absolute scale * 2^-10. Plus float32 rounding.
            bound = (
                torch.where(scaled >= 2.0**-6, x.abs() * 2.0**-4, scale * 2.0**-10)
                + x.abs() * 2.0**-21
            )
        else:
            # bf16 keeps 8 significant bits: round to nearest is within 2^-8 relative.
            bound = x.abs() * 2.0**-8
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
        assert bool(torch.isfinite(got).all())


# Zeros and non-finite values #


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_zero_blocks_decode_to_zeros(fmt: str) -> None:
    layout = WireLayout(fmt, 8, (20, 8, 3))
    segments = [torch.zeros(2, n) for n in layout.numels]
    segments[0][:, 8:16] = torch.randn(2, 8)  # a nonzero block between zero blocks
    wire = _encoded(segments, layout)
    for got, want in zip(_decoded(wire, layout), segments):
        assert not bool(got.isnan().any())
        zero = want == 0
        assert bool((got[zero] == 0).all())
    if fmt != "bf16":
        scales = wire[:, layout.codes_nbytes :].clone().view(torch.float32)  # (2, blocks)
        assert scales.tolist() == [[0.0, scales[r, 1].item(), 0.0, 0.0, 0.0] for r in (0, 1)]


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_block_stays_non_finite(fmt: str, bad: float) -> None:
    # GradScaler must still see the overflow after the codec: the poisoned block decodes
    # non-finite (every element for the block formats, via its non-finite scale), and
    # the other blocks decode as if the block were finite.
    block_size = 8
    layout = WireLayout(fmt, block_size, (24, 5))
    clean = _random_segments(layout.numels, rows=1)
    poisoned = [s.clone() for s in clean]
    poisoned[0][0, 10] = bad  # element 2 of block 1
    got = _decoded(_encoded(poisoned, layout), layout)
    want = _decoded(_encoded(clean, layout), layout)
    block = slice(8, 16) if fmt != "bf16" else slice(10, 11)
    assert not bool(torch.isfinite(got[0][0, block]).any())
    rest = torch.ones(24, dtype=torch.bool)
    rest[block] = False
    assert torch.equal(got[0][0, rest], want[0][0, rest])
    assert torch.equal(got[1], want[1])
    summed = decode_sum(_encoded(poisoned, layout), layout)
    assert not bool(torch.isfinite(summed[0][block]).any())


# decode_sum #


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_decode_sum_is_the_float32_sum_of_row_decodes(fmt: str) -> None:
    world_size = 4
    layout = WireLayout(fmt, 16, (40, 3, 0, 17))
    segments = _random_segments(layout.numels, rows=world_size, dtype=torch.bfloat16)
    wire = _encoded(segments, layout)  # (W, nbytes): row r = rank r's encoding
    rows = [_decoded(wire[r : r + 1], layout) for r in range(world_size)]
    summed = decode_sum(wire, layout)
    for i, total in enumerate(summed):
        assert total.dtype == torch.float32 and total.shape == (layout.numels[i],)
        # Same float32 elementwise dequantization, same reduction over the rank dim.
        assert torch.equal(total, torch.cat([row[i] for row in rows]).sum(dim=0))


def test_decode_sum_accumulates_bf16_wire_in_float32() -> None:
    # 1 + 2^-8 + 2^-8: bf16 accumulation rounds 1 + 2^-8 back to 1 (ties to even) and
    # returns 1; float32 keeps 1 + 2^-7.
    layout = WireLayout("bf16", 4, (1,))
    wire = _encoded([torch.tensor([[1.0], [2.0**-8], [2.0**-8]])], layout)
    (total,) = decode_sum(wire, layout)
    assert total.dtype == torch.float32
    assert total.item() == 1.0 + 2.0**-7


# quantization_error #


def test_quantization_error() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=gen)  # (64, 64)
    x[0, 0] = 100.0  # one outlier: with one 4096-element block, int8's step becomes ~0.8
    assert quantization_error(x.bfloat16(), "bf16", 32) == 0.0
    assert quantization_error(torch.zeros(10), "int8", 32) == 0.0
    # Blocks of 32 gaussians: absmax ~2.5, step ~0.02, relative error ~0.01; one block:
    # most values sit within one or two 0.8 steps of zero, relative error ~0.1.
    fine, coarse = quantization_error(x, "int8", 32), quantization_error(x, "int8", 4096)
    assert 0 < fine < 0.02 and coarse > 0.1
    # Per-element bounds carry over to the L2 ratio.
    assert quantization_error(x, "fp8_e4m3", 32) < 2.0**-4
    assert 0 < quantization_error(x, "bf16", 32) < 2.0**-8


# Errors #


@pytest.mark.parametrize("fmt", ["fp16", "int4", "", "INT8"])
def test_bad_format_names_the_allowed_ones(fmt: str) -> None:
    with pytest.raises(ValueError, match="'bf16', 'int8', 'fp8_e4m3'"):
        WireLayout(fmt, 32, (8,))


@pytest.mark.parametrize("block_size", [0, -4, 6, 2, 32.0, True])
def test_bad_block_size_says_positive_multiple_of_4(block_size) -> None:
    with pytest.raises(ValueError, match="positive int multiple of 4"):
        WireLayout("int8", block_size, (8,))


def test_mismatched_tensors_are_rejected() -> None:
    layout = WireLayout("int8", 8, (4, 5))
    wire = torch.empty(2, layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected 2 segments"):
        encode([torch.zeros(2, 4)], layout, wire)
    with pytest.raises(ValueError, match=r"segments\[1\] must be a floating \(2, 5\)"):
        encode([torch.zeros(2, 4), torch.zeros(2, 6)], layout, wire)
    with pytest.raises(ValueError, match=rf"out must be a \(rows, {layout.nbytes}\) uint8"):
        encode([torch.zeros(2, 4), torch.zeros(2, 5)], layout, wire.view(torch.int8))
    with pytest.raises(ValueError, match=r"outs\[0\] must be a floating \(2, 4\)"):
        decode(wire, layout, [torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 5)])
    with pytest.raises(ValueError, match="wire must be a"):
        decode_sum(wire[:, 1:], layout)
