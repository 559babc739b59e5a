"""`stream_weights`: a model's full weights as buckets of ``(name, tensor)`` pairs, the
shape of vLLM's ``load_weights(Iterable[tuple[str, Tensor]])``, gathered bucket by
bucket with at most two buckets alive: the one the consumer reads, and the next one,
whose gathers run meanwhile.

[Note: two buckets in flight]
A bucket is a ``list``; when the consumer asks for the next one, the stream empties the
list it handed out before, so its tensors are freed unless the consumer kept them (a
copy into the engine's weights, as vLLM's loader makes, keeps nothing). Then it
finishes the next bucket (issued while the consumer read this one), issues the gathers
of the one after, and hands out the finished one. Alive at any time: the bucket being
read and the bucket being gathered, plus the transients of one finishing tensor (a
Shard(dim != 0) or tensor-parallel reassembly, a fusion, a LoRA merge).
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import lora
from .gather import GatherInFlight, start_gather
from .names import NameMap, same_names
from .plan import PARAM_DTYPE, Output, StreamDtype, StreamPlan, Unit, plan_stream

Bucket = list[tuple[str, torch.Tensor]]
MIB = 1 << 20


def stream_weights(
    model: nn.Module,
    *,
    bucket_mb: float = 512,
    dtype: StreamDtype = None,
    name_map: NameMap = same_names,
    rank: int | None = None,
    merge_lora: bool = True,
) -> Iterator[Bucket]:
    """Stream ``model``'s full (unsharded) weights in buckets, for an inference engine.

    Every rank of the model's process groups must iterate the stream to its end, with
    the same arguments: each bucket is gathered by collectives. Group by group, each
    FSDP parameter is gathered from its group's sharded buffer as it is (the model is
    not changed: unsharded groups stay unsharded, and the stream may run between any
    two iterations); at most two buckets are alive at a time ([Note: two buckets in
    flight]), never the whole model. Works for FSDP, HSDP, FSDP with tensor or expert
    parallelism (DTensor gathers the TP/EP shards), tied weights (one gather, every
    name), CPU offload and mixed precision. Buffers and parameters dtensor_fsdp does not
    manage are streamed too (``full_tensor()`` for a DTensor).

    Args:
        model: the model (a ``fully_shard`` root, or any module).
        bucket_mb: a bucket holds tensors of at most this many MiB (a tensor larger
            than a bucket gets a bucket of its own).
        dtype: ``None``: each weight in its own dtype (the fp32 masters under mixed
            precision); a floating-point dtype: floating-point weights cast to it
            (bitwise the cast of the full tensor); ``"param_dtype"``
            (``post_training.PARAM_DTYPE``): each FSDP parameter in its
            ``MixedPrecisionPolicy.param_dtype``.
        name_map: the engine's name for each weight (a `NameMap`: ``str``, `Target`
            with a rearrangement or a fusion, or ``None`` to leave it out), e.g.
            ``llama_to_hf(config)``.
        rank: ``None``: every rank gets the buckets; a global rank: only that rank
            does (the others gather with it and get nothing), e.g. the rank that sends
            them to the engine.
        merge_lora: stream each peft LoRA layer's base weight with its active
            adapters merged (peft's arithmetic, on the gathered copies: the
            parameters are not touched) under the merged model's names, and no
            adapter weights; ``False`` streams the state dict's names as they are.

    Returns:
        An iterator of buckets, each a list of ``(name, full tensor)`` pairs on the
        mesh's device. A bucket is emptied when the next one is requested: copy what
        you keep. A tensor may be a view of the model's own state (a buffer in its
        dtype): do not write into it.

    Raises:
        ValueError: a bad ``bucket_mb``, ``dtype`` or ``rank``; a name map that maps
            two weights to one name, or a fusion whose parts do not all map to it;
            a weight on the meta device.
        TypeError: ``name_map`` returned something else than ``str``, `Target` or
            ``None``.
        NotImplementedError: with ``merge_lora``, a LoRA layer that is not plain LoRA
            on a Linear (DoRA, ``lora_bias``, embeddings).
        All before any collective.
    """
    if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or bucket_mb <= 0:
        raise ValueError(f"stream_weights: bucket_mb must be a positive number, got {bucket_mb!r}")
    if not (dtype is None or dtype == PARAM_DTYPE or _is_float_dtype(dtype)):
        raise ValueError(
            f"stream_weights: dtype must be None, a floating-point torch.dtype or "
            f"{PARAM_DTYPE!r}, got {dtype!r}"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world):
        raise ValueError(
            f"stream_weights: rank must be None or a global rank < {world}, got {rank!r}"
        )
    plan = plan_stream(model, int(bucket_mb * MIB), dtype, name_map, merge_lora)
    receives = rank is None or (dist.get_rank() if dist.is_initialized() else 0) == rank
    return _buckets(plan, receives)


def _is_float_dtype(dtype: object) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _buckets(plan: StreamPlan, receives: bool) -> Iterator[Bucket]:
    """The pipeline of [Note: two buckets in flight]."""
    buckets = plan.buckets
    in_flight = _start(buckets[0], plan) if buckets else []
    for index in range(len(buckets)):
        bucket = _finish(buckets[index], in_flight)
        in_flight = _start(buckets[index + 1], plan) if index + 1 < len(buckets) else []
        if receives:
            yield bucket
        bucket.clear()


def _start(units: tuple[Unit, ...], plan: StreamPlan) -> list[GatherInFlight]:
    return [
        start_gather(source, plan.gather_dtypes[id(source)])
        for unit in units
        for source in unit.sources
    ]


def _finish(units: tuple[Unit, ...], in_flight: list[GatherInFlight]) -> Bucket:
    """Each unit's outputs from its sources' full tensors, unit by unit: a unit's
    sources are released before the next unit's are finished."""
    pending = iter(in_flight)
    bucket: Bucket = []
    for unit in units:
        full = {id(source): next(pending).finish() for source in unit.sources}
        for output in unit.outputs:
            bucket.append((output.name, _assemble(output, full)))
        del full
    return bucket


def _assemble(output: Output, full: dict[int, torch.Tensor]) -> torch.Tensor:
    """One engine tensor: each part merged (LoRA), cast, rearranged, then fused."""
    parts = []
    for weight, target in output.parts:
        if weight.merge is not None:
            keyed = {
                key: full[id(source)]
                for key, source in zip(weight.merge.keys, weight.sources, strict=True)
            }
            value = lora.merge(weight.merge, keyed)
        else:
            value = full[id(weight.base)]
        value = value.to(output.dtype)  # after a merge; else cast before the gather
        parts.append(target.rearrange(value) if target.rearrange is not None else value)
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=output.fuse_dim)
