"""What a weight stream sends, decided before anything is gathered: each engine tensor
(`Output`) from the trainer's weights (LoRA merges, the name map, fusion), the units
that must be gathered together, the dtype each source is gathered in, and the buckets.

Every check happens here, on every rank alike, so that a bad name map or dtype raises
the same error everywhere before the first collective.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .lora import LoraMerge, find_lora_merges, lora_parameter_keys, merged_name
from .names import NameMap, Target
from .sources import Source, collect_sources

PARAM_DTYPE = "param_dtype"
"""``dtype=PARAM_DTYPE``: each FSDP parameter in the dtype it computes in
(``MixedPrecisionPolicy.param_dtype``), the rest as they are."""

StreamDtype = torch.dtype | Literal["param_dtype"] | None


@dataclass(frozen=True)
class Weight:
    """One trainer weight after LoRA merging: a source as it is, or a merge of several
    (the base weight first)."""

    name: str  # the merged model's name (the state-dict key without LoRA)
    sources: tuple[Source, ...]
    merge: LoraMerge | None = None

    @property
    def base(self) -> Source:
        return self.sources[0]


@dataclass(frozen=True)
class Output:
    """One engine tensor: the weights ``parts`` (rearranged), fused along ``fuse_dim``."""

    name: str
    parts: tuple[tuple[Weight, Target], ...]
    fuse_dim: int
    dtype: torch.dtype  # what is streamed
    nbytes: int


@dataclass(frozen=True)
class Unit:
    """Outputs that share sources (a tied weight, a fusion, a merge): gathered into one
    bucket, their sources once each."""

    sources: tuple[Source, ...]
    outputs: tuple[Output, ...]

    @property
    def nbytes(self) -> int:
        return sum(output.nbytes for output in self.outputs)


@dataclass(frozen=True)
class StreamPlan:
    buckets: tuple[tuple[Unit, ...], ...]
    # By id(source): the dtype it is gathered in. Cast before the gather (a cast
    # commutes with moving elements) unless a LoRA merge computes with it first.
    gather_dtypes: dict[int, torch.dtype]


def plan_stream(
    model: nn.Module,
    bucket_bytes: int,
    dtype: StreamDtype,
    name_map: NameMap,
    merge_lora: bool,
) -> StreamPlan:
    """The plan of ``stream_weights(model, ...)``; see its docstring for the errors."""
    sources = collect_sources(model)
    weights = _weights(model, sources, merge_lora)
    units = _units(_outputs(weights, name_map, dtype), sources)
    buckets: list[list[Unit]] = []
    filled = 0
    for unit in units:
        if not buckets or (buckets[-1] and filled + unit.nbytes > bucket_bytes):
            buckets.append([])  # a unit larger than a bucket gets one of its own
            filled = 0
        buckets[-1].append(unit)
        filled += unit.nbytes
    merged = {id(s) for w in weights if w.merge is not None for s in w.sources}
    gather_dtypes = {
        id(source): source.dtype if id(source) in merged else _out_dtype(source, dtype)
        for source in sources
    }
    return StreamPlan(tuple(tuple(b) for b in buckets), gather_dtypes)


def _weights(model: nn.Module, sources: list[Source], merge_lora: bool) -> list[Weight]:
    """The trainer's weights in source order: with ``merge_lora``, each LoRA layer's
    base weight becomes its merge and its adapters are left out."""
    keys = {name: source for source in sources for name in source.names}
    merges = {m.base: m for m in find_lora_merges(model)} if merge_lora else {}
    missing = [k for m in merges.values() for k in m.keys if k not in keys]
    if missing:
        raise ValueError(f"stream_weights: LoRA weights {missing} are not in the state dict")
    dropped = lora_parameter_keys(model) if merges else set()
    weights = []
    for source in sources:
        for name in source.names:
            if name in dropped:
                continue
            merge = merges.get(name)
            if merge is None:
                weights.append(Weight(merged_name(name) if merges else name, (source,)))
            else:
                parts = tuple(keys[key] for key in merge.keys)
                weights.append(Weight(merged_name(name), parts, merge))
    return weights


def _outputs(weights: list[Weight], name_map: NameMap, dtype: StreamDtype) -> list[Output]:
    """Each engine tensor, in the order of its first weight; checked for clashes and
    incomplete fusions."""
    by_name = {w.name: w for w in weights}
    targets: dict[str, list[tuple[Weight, Target]]] = {}
    for weight in weights:
        target = name_map(weight.name)
        if target is None:
            continue
        if isinstance(target, str):
            target = Target(target)
        if not isinstance(target, Target):
            raise TypeError(
                f"stream_weights: name_map({weight.name!r}) returned {type(target).__name__}: "
                "return the engine's name (str), a Target, or None to leave it out"
            )
        targets.setdefault(target.name, []).append((weight, target))
    return [_output(name, parts, by_name, dtype) for name, parts in targets.items()]


def _output(
    name: str,
    parts: list[tuple[Weight, Target]],
    by_name: dict[str, Weight],
    dtype: StreamDtype,
) -> Output:
    first = parts[0][1]
    if not first.fuse:
        if len(parts) > 1:
            raise ValueError(
                f"stream_weights: name_map maps {[w.name for w, _ in parts]} all to {name!r}: "
                "give each its own name, or fuse them with Target(name, fuse=(...))"
            )
        weight = parts[0][0]
        out_dtype = _out_dtype(weight.base, dtype)
        return Output(name, tuple(parts), 0, out_dtype, _nbytes(weight, out_dtype))
    mapped = {w.name: t for w, t in parts}
    missing = [n for n in first.fuse if n not in by_name]
    if (
        missing
        or set(mapped) != set(first.fuse)
        or any((t.fuse, t.fuse_dim) != (first.fuse, first.fuse_dim) for t in mapped.values())
    ):
        raise ValueError(
            f"stream_weights: the fused tensor {name!r} lists {list(first.fuse)}, but "
            f"{[w.name for w, _ in parts]} map to it"
            + (f", and {missing} are not weights of the model" if missing else "")
            + ": every part must be a weight of the model and map to the same Target"
        )
    ordered = tuple((by_name[n], mapped[n]) for n in first.fuse)
    dtypes = {_out_dtype(w.base, dtype) for w, _ in ordered}
    if len(dtypes) > 1:
        raise ValueError(f"stream_weights: the parts of {name!r} stream in dtypes {dtypes}")
    out_dtype = dtypes.pop()
    nbytes = sum(_nbytes(w, out_dtype) for w, _ in ordered)
    return Output(name, ordered, first.fuse_dim, out_dtype, nbytes)


def _out_dtype(source: Source, dtype: StreamDtype) -> torch.dtype:
    """What ``source`` streams as: floating-point weights are cast."""
    if not source.dtype.is_floating_point or dtype is None:
        return source.dtype
    if dtype == PARAM_DTYPE:
        return source.fsdp_param.param_dtype if source.fsdp_param is not None else source.dtype
    assert isinstance(dtype, torch.dtype)
    return dtype


def _nbytes(weight: Weight, out_dtype: torch.dtype) -> int:
    return math.prod(weight.base.full_shape) * out_dtype.itemsize


def _units(outputs: list[Output], sources: Sequence[Source]) -> list[Unit]:
    """Outputs joined by shared sources, ordered by their first source in ``sources``
    (group by group); each unit's sources in that order too."""
    position = {id(source): index for index, source in enumerate(sources)}
    parent = list(range(len(outputs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_user: dict[int, int] = {}
    for index, output in enumerate(outputs):
        for source in _output_sources(output):
            other = first_user.setdefault(id(source), index)
            parent[root(index)] = root(other)
    members: dict[int, list[int]] = {}
    for index in range(len(outputs)):
        members.setdefault(root(index), []).append(index)
    units = []
    for indices in members.values():
        unit_sources = {id(s): s for i in indices for s in _output_sources(outputs[i])}
        ordered = sorted(unit_sources.values(), key=lambda s: position[id(s)])
        units.append(Unit(tuple(ordered), tuple(outputs[i] for i in indices)))
    return sorted(units, key=lambda u: position[id(u.sources[0])])


def _output_sources(output: Output) -> list[Source]:
    return [source for weight, _ in output.parts for source in weight.sources]
