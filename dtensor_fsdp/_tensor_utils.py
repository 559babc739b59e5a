"""Shard arithmetic and storage management, shared by param.py and param_group.py.

Sharding follows ``torch.chunk`` along dim 0, which is what DTensor's ``Shard(0)`` means
for an uneven dim: every rank's chunk has ``ceil(dim0 / W)`` rows except the trailing
ones, which are shorter or empty. Internally every chunk is padded to the full
``ceil(dim0 / W)`` rows so that all ranks contribute equal-sized pieces to a collective.
"""

import math

import torch


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows of a full (padded) chunk: ``torch.chunk``'s chunk size."""
    return math.ceil(dim0 / world_size)


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows this rank really owns under ``torch.chunk`` semantics (may be 0)."""
    rows = chunk_rows(dim0, world_size)
    return max(0, min(rows, dim0 - rank * rows))


def padded_shard_nbytes(shape: torch.Size, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one rank's padded chunk of a tensor of ``shape``."""
    return chunk_rows(shape[0], world_size) * math.prod(shape[1:]) * dtype.itemsize


def free_storage(tensor: torch.Tensor) -> None:
    """Release the memory behind ``tensor`` but keep the tensor object (and its views).

    Autograd may have saved ``tensor`` for backward; keeping the object and only
    resizing its storage lets the backward all-gather refill the same storage.
    """
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give ``tensor``'s (freed) storage ``nbytes`` again; contents are uninitialized."""
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def is_storage_freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0
