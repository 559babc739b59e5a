"""Pick a ``CommPrecisionPolicy`` block size: per-parameter quantization error of the
weights and gradients of the main job's Llama, as FSDP would quantize them.

    python tools/quant_error.py                          # tiny Llama, W = 8
    python tools/quant_error.py --model small --world-size 64 --block-sizes 32,64,128,256
    python tools/quant_error.py --checkpoint ckpt/step_00000300   # train.py's DCP dir
    python tools/quant_error.py --checkpoint model.pt    # a torch.save'd state dict

One process, no process group. The model is built (``init_weights`` from ``--seed``, as
``train.py`` does) or loaded from ``--checkpoint``, then one forward and backward on a
random token batch gives the gradients. Each parameter is then encoded and decoded with
``dtensor_fsdp.comm_precision.wire_format`` as FSDP does over ``--world-size`` ranks:

- weights (all-gather): the parameter is padded along dim 0 to ``W * ceil(d0 / W)``
  rows and cut into W shards; each rank's padded shard is one segment of its own row,
  so quantization blocks never cross a shard (nor a parameter) boundary;
- gradients (reduce-scatter): each destination rank's chunk is a separate segment in
  the same way. In a real run every rank quantizes its *local* gradient (before the sum)
  and the receiver sums the decoded chunks; this tool has one process, so it quantizes
  the one gradient it has, whose statistics are those of a local gradient.

The error is the relative L2 error over the whole parameter,
``||decode(encode(x)) - x|| / ||x||`` (0 for an all-zero tensor). Padding is zeros and
decodes to zeros, so it adds no error (but it does add bytes: see ``bytes/elem``).

Every parameter is listed; ``q`` marks those that ``CommPrecisionPolicy``'s default
``param_filter`` quantizes (2+ dims); the others travel exactly by default, and the
summary covers only the ``q`` ones. Per (format, block size) the summary gives the max
and median error, the scale overhead ``4 / block_size`` bytes per element, and the
actual wire bytes per element over the ``q`` parameters, block padding included
(fp32 sends 4, so bytes/elem / 4 is the ratio to fp32). ``bf16`` has no blocks or
scales: it is listed once.
"""

import argparse
import dataclasses
import math
import os
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp

from dtensor_fsdp.api import CommPrecisionPolicy
from dtensor_fsdp.comm_precision.wire_format import WIRE_FORMATS, WireLayout, decode, encode
from dtensor_fsdp.models.llama import PRESETS, Llama, cross_entropy_loss, swiglu_hidden_dim

DEFAULT_BLOCK_SIZES = (64, 128, 256, 512)
DEFAULT_FORMATS = ("int8", "fp8_e4m3", "bf16")


@dataclass(frozen=True)
class Scheme:
    """One wire format at one block size (``block_size`` is None for ``bf16``)."""

    fmt: str
    block_size: int | None

    @property
    def label(self) -> str:
        return self.fmt if self.block_size is None else f"{self.fmt}@{self.block_size}"


@dataclass(frozen=True)
class ParamError:
    """One parameter's errors, per scheme in ``QuantErrorReport.schemes`` order."""

    fqn: str
    shape: tuple[int, ...]
    is_quantized_by_default: bool
    weight_errors: tuple[float, ...]
    grad_errors: tuple[float, ...]
    wire_nbytes: tuple[int, ...]  # per scheme: the W rows' encoded bytes
    numel: int


@dataclass(frozen=True)
class QuantErrorReport:
    world_size: int
    schemes: tuple[Scheme, ...]
    params: tuple[ParamError, ...]


# Measurement #


def sharded_rows(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """FSDP's padded shards of ``tensor`` as a (W, padded shard numel) float32 tensor:
    dim 0 zero-padded to ``W * ceil(d0 / W)`` rows, row r = rank r's shard (or, for a
    gradient, the chunk destined for rank r)."""
    flat = tensor.detach().reshape(tensor.shape[0], -1).to(torch.float32)  # (d0, rest)
    rows_per_rank = math.ceil(flat.shape[0] / world_size)
    padded = flat.new_zeros(world_size * rows_per_rank, flat.shape[1])  # (W * rows, rest)
    padded[: flat.shape[0]] = flat
    return padded.view(world_size, -1)  # (W, rows * rest)


def sharded_quantization_error(
    tensor: torch.Tensor, fmt: str, block_size: int, world_size: int
) -> tuple[float, int]:
    """Relative L2 error of encoding each rank's padded shard of ``tensor`` separately,
    and the encoded bytes of all W rows.

    Args:
        tensor: a parameter or gradient with at least one dim.
        fmt: a wire format (``"bf16"``, ``"int8"``, ``"fp8_e4m3"``).
        block_size: elements per block (ignored by ``"bf16"``, but must be valid).
        world_size: the number of shards W.

    Returns:
        ``(error, nbytes)``: ``||x_hat - x|| / ||x||`` (0.0 for an all-zero tensor), and
        ``W * WireLayout.nbytes``.
    """
    rows = sharded_rows(tensor, world_size)  # (W, s)
    layout = WireLayout(fmt, block_size, (rows.shape[1],))
    wire = torch.empty(world_size, layout.nbytes, dtype=torch.uint8)  # (W, nbytes)
    encode([rows], layout, wire)
    decoded = torch.empty_like(rows)  # (W, s)
    decode(wire, layout, [decoded])
    reference = rows.to(torch.float64)
    norm = torch.linalg.vector_norm(reference).item()
    if norm == 0.0:
        return 0.0, wire.numel()
    error = torch.linalg.vector_norm(decoded.to(torch.float64) - reference).item() / norm
    return error, wire.numel()


def build_model(args: argparse.Namespace) -> Llama:
    """The main job's Llama (``--model`` preset with the shape flags), initialized from
    ``--seed`` or loaded from ``--checkpoint``."""
    config = PRESETS[args.model]()
    overrides: dict[str, int] = {}  # the same shape flags as train.py's
    if args.dim is not None:
        overrides.update(dim=args.dim, ffn_hidden_dim=swiglu_hidden_dim(args.dim))
    if args.n_layers is not None:
        overrides["n_layers"] = args.n_layers
    if args.seq_len is not None:
        overrides["max_seq_len"] = args.seq_len
    config = dataclasses.replace(config, **overrides)
    torch.manual_seed(args.seed)
    model = Llama(config)
    if args.checkpoint is not None:
        load_weights(model, args.checkpoint)
    return model


def load_weights(model: Llama, path: str) -> None:
    """Load a full state dict saved with ``torch.save`` (optionally under ``"model"``),
    or a ``train.py`` / ``dtensor_fsdp.checkpoint`` DCP directory (resharded to full
    tensors by DCP, in this one process)."""
    if os.path.isdir(path):
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            # DCP warns that it "assumes the intent is to load in a single process": it is.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
        model.load_state_dict(state["model"])
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state.get("model", state) if isinstance(state, dict) else state)


def compute_grads(model: Llama, batch_size: int, seed: int) -> None:
    """One forward and backward on uniformly random tokens: fills every ``.grad``."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        config.vocab_size, (batch_size, config.max_seq_len + 1), generator=generator
    )  # (B, T + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    cross_entropy_loss(model(inputs), targets).backward()


def measure(model: Llama, world_size: int, schemes: Sequence[Scheme]) -> QuantErrorReport:
    """Every parameter's weight and gradient error under every scheme (grads must be set)."""
    default_filter = CommPrecisionPolicy().param_filter
    params = []
    for fqn, param in model.named_parameters():
        weight, grad = [], []
        nbytes = []
        for scheme in schemes:
            block_size = scheme.block_size or 4  # bf16 ignores it; WireLayout wants one
            error, wire_nbytes = sharded_quantization_error(
                param, scheme.fmt, block_size, world_size
            )
            weight.append(error)
            nbytes.append(wire_nbytes)
            grad_error = (
                sharded_quantization_error(param.grad, scheme.fmt, block_size, world_size)[0]
                if param.grad is not None
                else math.nan
            )
            grad.append(grad_error)
        params.append(
            ParamError(
                fqn=fqn,
                shape=tuple(param.shape),
                is_quantized_by_default=default_filter(fqn, param),
                weight_errors=tuple(weight),
                grad_errors=tuple(grad),
                wire_nbytes=tuple(nbytes),
                numel=param.numel(),
            )
        )
    return QuantErrorReport(world_size, tuple(schemes), tuple(params))


# Report #


def format_report(report: QuantErrorReport) -> str:
    """The per-parameter tables (weights, then grads) and the per-scheme summary."""
    width = max(len(p.fqn) for p in report.params)
    labels = [s.label for s in report.schemes]
    lines = [
        f"relative L2 quantization error, FSDP shards of W = {report.world_size} ranks "
        + "(q: quantized by the default param_filter)"
    ]
    for title, attribute in (("weights (all-gather)", "weight_errors"), ("grads", "grad_errors")):
        header = f"{'param':<{width}} {'shape':>14} q " + " ".join(f"{x:>12}" for x in labels)
        lines += ["", title, header, "-" * len(header)]
        for p in report.params:
            errors = " ".join(f"{e:>12.3e}" for e in getattr(p, attribute))
            shape = "x".join(map(str, p.shape))
            lines.append(
                f"{p.fqn:<{width}} {shape:>14} {'q' if p.is_quantized_by_default else ' '} {errors}"
            )
    quantized = [p for p in report.params if p.is_quantized_by_default]
    numel = sum(p.numel for p in quantized)
    header = (
        f"{'scheme':<14} {'weight max':>11} {'weight med':>11} {'grad max':>11} "
        f"{'grad med':>11} {'scales B/elem':>13} {'bytes/elem':>10} {'vs fp32':>8}"
    )
    lines += ["", f"summary over the {len(quantized)} q params", header, "-" * len(header)]
    for index, scheme in enumerate(report.schemes):
        weights = [p.weight_errors[index] for p in quantized]
        grads = [p.grad_errors[index] for p in quantized if not math.isnan(p.grad_errors[index])]
        scales = 4 / scheme.block_size if scheme.block_size is not None else 0.0
        per_elem = sum(p.wire_nbytes[index] for p in quantized) / numel
        lines.append(
            f"{scheme.label:<14} {_max(weights):>11.3e} {_median(weights):>11.3e} "
            f"{_max(grads):>11.3e} {_median(grads):>11.3e} {scales:>13.4f} "
            f"{per_elem:>10.4f} {per_elem / 4:>8.4f}"
        )
    return "\n".join(lines)


def _max(values: list[float]) -> float:
    return max(values) if values else math.nan


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# Command line #


def parse_int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(",") if item)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python tools/quant_error.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dim", type=int, help="override the preset (ffn width follows)")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--seq-len", type=int, help="override the preset's max_seq_len")
    parser.add_argument("--checkpoint", help="a torch.save'd state dict, or a DCP directory")
    parser.add_argument("--world-size", type=int, default=8, help="FSDP shards W")
    parser.add_argument(
        "--block-sizes",
        type=parse_int_list,
        default=DEFAULT_BLOCK_SIZES,
        help="comma-separated, each a positive multiple of 4 (default 64,128,256,512)",
    )
    parser.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated subset of {','.join(WIRE_FORMATS)}",
    )
    parser.add_argument("--batch-size", type=int, default=2, help="sequences for the grads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.formats = tuple(f for f in args.formats.split(",") if f)
    if not args.formats or any(f not in WIRE_FORMATS for f in args.formats):
        parser.error(f"--formats must be a comma-separated subset of {','.join(WIRE_FORMATS)}")
    if not args.block_sizes or any(b <= 0 or b % 4 for b in args.block_sizes):
        parser.error("--block-sizes must be positive multiples of 4, e.g. 64,128,256")
    if args.world_size < 1 or args.batch_size < 1:
        parser.error("--world-size and --batch-size must be at least 1")
    return args


def schemes_for(formats: Sequence[str], block_sizes: Sequence[int]) -> tuple[Scheme, ...]:
    """Every quantized format at every block size, then bf16 once (it has no blocks)."""
    schemes = [Scheme(f, b) for f in formats if f != "bf16" for b in block_sizes]
    if "bf16" in formats:
        schemes.append(Scheme("bf16", None))
    return tuple(schemes)


def main(argv: Sequence[str] | None = None) -> None:
    """Build (or load) the model, compute its grads, print the error tables."""
    args = parse_args(argv)
    model = build_model(args)
    compute_grads(model, args.batch_size, args.seed)
    report = measure(model, args.world_size, schemes_for(args.formats, args.block_sizes))
    print(format_report(report))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
