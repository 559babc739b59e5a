"""Shard arithmetic and storage management, shared by param.py and param_group.py.

Sharding follows ``torch.chunk`` along dim 0, which is what DTensor's ``Shard(0)`` means
for an uneven dim: every rank's chunk has ``ceil(dim0 / W)`` rows except the trailing
ones, which are shorter or empty. Internally every chunk is padded to the full
``ceil(dim0 / W)`` rows so that all ranks contribute equal-sized pieces to a collective.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

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
    shapes are computed once: every unshard and gradient landing reads them.
    """

    shape: torch.Size
    dim: int
    world_size: int
    rank: int

    @cached_property
    def padded_local_shape(self) -> torch.Size:
        if self.dim == 0:
            return torch.Size((chunk_rows(self.shape[0], self.world_size), *self.shape[1:]))
        return self._with_dim(self.shape[self.dim] // self.world_size)

    @cached_property
    def local_shape(self) -> torch.Size:
        if self.dim == 0:
            rows = local_rows(self.shape[0], self.world_size, self.rank)
            return torch.Size((rows, *self.shape[1:]))
        return self.padded_local_shape

    @cached_property
    def padded_unsharded_shape(self) -> torch.Size:
        """W padded chunks stacked along ``dim``: what the all-gather output becomes."""
        local = self.padded_local_shape
        return torch.Size(
            (*local[: self.dim], self.world_size * local[self.dim], *local[self.dim + 1 :])
        )

    @cached_property
    def padded_shard_numel(self) -> int:
        return math.prod(self.padded_local_shape)

    @cached_property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def local_chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's (unpadded) chunk of ``tensor``, a view."""
        if self.dim == 0:
            start = self.rank * chunk_rows(self.shape[0], self.world_size)
            return tensor[start : start + self.local_shape[0]]
        return tensor.chunk(self.world_size, dim=self.dim)[self.rank]

    def _with_dim(self, size: int) -> torch.Size:
        return torch.Size((*self.shape[: self.dim], size, *self.shape[self.dim + 1 :]))


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


def free_storage(tensor: torch.Tensor) -> None:
    """Release the memory behind ``tensor`` but keep the tensor object (and its views).

    Autograd may have saved ``tensor`` for backward; keeping the object and only
    resizing its storage lets the backward all-gather refill the same storage.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give ``tensor``'s (freed) storage ``nbytes`` again; contents are uninitialized."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def is_storage_freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0
