"""Shard geometry: how a tensor splits over the ranks, and a local shard as a DTensor.

Sharding follows ``torch.chunk`` along dim 0, which is what DTensor's ``Shard(0)`` means
for an uneven dim: every rank's chunk has ``ceil(dim0 / W)`` rows except the trailing
ones, which are shorter or empty. Internally every chunk is padded to the full
``ceil(dim0 / W)`` rows so that all ranks contribute equal-sized pieces to a collective.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows of a full (padded) chunk: ``torch.chunk``'s chunk size."""
    return math.ceil(dim0 / world_size)


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows this rank really owns under ``torch.chunk`` semantics (may be 0)."""
    rows = chunk_rows(dim0, world_size)
    return max(0, min(rows, dim0 - rank * rows))


@dataclass(frozen=True)
class ShardGeometry:
    """How a tensor of ``shape`` is split over ``world_size`` ranks along ``dim``.

    Dim 0 follows ``torch.chunk`` and pads every chunk to ``ceil(dim0 / W)`` rows. Any
    other dim must divide evenly (``fully_shard`` checks), so nothing is padded. The
    derived shapes are fields computed once, at construction: every unshard and
    gradient landing reads them, and graph mode's traced code too (dynamo cannot trace
    ``functools.cached_property``'s lock).
    """

    shape: torch.Size
    dim: int
    world_size: int
    rank: int
    padded_local_shape: torch.Size = field(init=False)
    local_shape: torch.Size = field(init=False)
    # W padded chunks stacked along ``dim``: what the all-gather output becomes.
    padded_unsharded_shape: torch.Size = field(init=False)
    padded_shard_numel: int = field(init=False)
    local_numel: int = field(init=False)

    def __post_init__(self) -> None:
        shape, dim, world_size = self.shape, self.dim, self.world_size
        if dim == 0:
            padded = torch.Size((chunk_rows(shape[0], world_size), *shape[1:]))
            local = torch.Size((local_rows(shape[0], world_size, self.rank), *shape[1:]))
        else:
            padded = torch.Size((*shape[:dim], shape[dim] // world_size, *shape[dim + 1 :]))
            local = padded
        unsharded = torch.Size((*padded[:dim], world_size * padded[dim], *padded[dim + 1 :]))
        for name, value in (
            ("padded_local_shape", padded),
            ("local_shape", local),
            ("padded_unsharded_shape", unsharded),
            ("padded_shard_numel", math.prod(padded)),
            ("local_numel", math.prod(local)),
        ):
            object.__setattr__(self, name, value)

    def local_chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's (unpadded) chunk of ``tensor``, a view."""
        if self.dim == 0:
            start = self.rank * chunk_rows(self.shape[0], self.world_size)
            return tensor[start : start + self.local_shape[0]]
        return tensor.chunk(self.world_size, dim=self.dim)[self.rank]


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def wrap_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """``local`` itself as the local tensor of a DTensor of global ``shape`` and
    ``stride``, not differentiable, as torch's FSDP2 builds its DTensors
    (``_from_local_no_grad``). ``DTensor.from_local`` would copy a local tensor whose
    device type is not the mesh's to the mesh's device: under CPU offload on an
    accelerator, a device copy of a host shard, optimizer state or norm."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)
