"""The collective strategies: who allocates a collective's buffer and who runs it.

torch 2.13's protocol (``api.AllGather`` / ``api.ReduceScatter``: ``allocate`` and
``__call__``), with torch's built-in strategies under torch's names, so that the
setters behave as torch's: every group starts with the defaults (the caching allocator,
``all_gather_single`` / ``reduce_scatter_single``);
``FSDPModule.set_allocate_memory_from_process_group_for_comm`` installs the
process-group allocator's (NCCL's, for zero-copy transfers; a backend without one, such
as gloo, falls back to the caching allocator, as torch's does);
``FSDPModule.set_symm_mem_for_comm`` the symmetric-memory ones (NCCL's copy-engine or
symmetric-kernel all-gather; a torch build without symmetric memory, a CPU one, raises
``RuntimeError`` from ``symm_mem.set_backend``, as torch's does); a user's
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` object is a strategy too.

A group's `GroupComm` (comm_description.py) holds its strategies; the eager runtime
calls them (collectives.py), graph mode runs the defaults as functional collectives,
which the compiler can bucket, and any other strategy as an opaque op that calls it
(graph/collectives.py).
"""

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ..api import AllGather, ReduceOp, ReduceScatter

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; 2.11
# has only the old ones. Same signature either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CachingAllocator:
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _ProcessGroupAllocator:
    """The process group's own allocator where its backend has one (NCCL's), else the
    caching allocator (torch's ``ProcessGroupAllocMixin``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        backend = self._group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


class _SymmetricMemoryAllocator:
    """Buffers from symmetric memory's pool (torch's ``SymmMemAllocMixin``)."""

    def __init__(self, group: dist.ProcessGroup, backend: str) -> None:
        self._group = group
        # Raises RuntimeError on a torch build without this backend (a CPU build).
        symm_mem.set_backend(backend)
        # As torch: the communicator must exist before the first rendezvous.
        dist.barrier(group=group)

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            return torch.empty(size, dtype=dtype, device=device)


class _AllGatherSingle:
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatterSingle:
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        # 1-D, as NCCL's users pass it: backends that split the input into W chunks
        # along dim 0 (torch's threaded group) would otherwise hand out (1, n) rows.
        return reduce_scatter_single(
            output_tensor, input_tensor.view(-1), op=op, group=group, async_op=async_op
        )


class DefaultAllGather(_CachingAllocator, _AllGatherSingle, AllGather):
    """Every group's all-gather unless a setter installs another."""


class ProcessGroupAllocAllGather(_ProcessGroupAllocator, _AllGatherSingle, AllGather):
    """``set_allocate_memory_from_process_group_for_comm(True)``'s all-gather."""


class SymmMemAllGather(_SymmetricMemoryAllocator, AllGather):
    """``set_symm_mem_for_comm``'s all-gather: its output in symmetric memory, so that
    NCCL runs its copy-engine (zero-CTA policy) or symmetric-kernel all-gather."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        # An in-place all-gather: only the output needs the rendezvous.
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class DefaultReduceScatter(_CachingAllocator, _ReduceScatterSingle, ReduceScatter):
    """Every group's reduce-scatter unless a setter installs another."""


class ProcessGroupAllocReduceScatter(_ProcessGroupAllocator, _ReduceScatterSingle, ReduceScatter):
    """``set_allocate_memory_from_process_group_for_comm(True)``'s reduce-scatter."""


class SymmMemReduceScatter(_SymmetricMemoryAllocator, ReduceScatter):
    """``set_symm_mem_for_comm``'s reduce-scatter, with
    ``set_force_sum_reduction_for_comms(True)`` only (NCCL's symmetric reduce-scatter
    sums only, as of NCCL 2.29.3; torch's condition)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        symm_mem.rendezvous(input_tensor, group=group.group_name)
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return reduce_scatter_single(
            output_tensor, input_tensor.view(-1), op=op, group=group, async_op=async_op
        )


# Strategies FSDP ships (torch's names): the rest are a user's set_custom_* objects.
BUILTIN_ALL_GATHERS = (DefaultAllGather, ProcessGroupAllocAllGather, SymmMemAllGather)
BUILTIN_REDUCE_SCATTERS = (DefaultReduceScatter, ProcessGroupAllocReduceScatter, SymmMemReduceScatter)


def is_custom(comm: Any) -> bool:
    """Whether ``comm`` is a user's strategy (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``), not one FSDP ships."""
    return not isinstance(comm, BUILTIN_ALL_GATHERS + BUILTIN_REDUCE_SCATTERS)
