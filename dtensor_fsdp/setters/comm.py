"""FSDPModule's settings of what and how its collectives communicate: precision,
custom strategies and allocators, the reduction's divisor, hook and process group
(torch's names and semantics where torch has them); bound as methods by fsdp_module.py."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..api import AllGather, CommPrecisionPolicy, ReduceScatter
from ..runtime.comm_strategies import (
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)
from ..runtime.param_group import FSDPParamGroup
from .groups import own_groups, single_mesh_groups, tree_groups, warn_if_graph_mode

# torch 2.13's symmetric memory allocation backends (torch.distributed._symmetric_memory).
_SYMMETRIC_MEMORY_BACKENDS = ("NCCL", "CUDA", "NVSHMEM")


class SetterError(ValueError, AssertionError):
    """An ``FSDPModule.set_*`` call torch's FSDP2 refuses with an AssertionError. A
    ValueError (a user mistake), and an AssertionError: torch's type."""


class SymmetricMemoryBackendError(ValueError, RuntimeError):
    """``set_symm_mem_for_comm`` with an unknown backend. A ValueError (a user mistake),
    and a RuntimeError: what torch's symmetric memory raises for it."""


def set_comm_precision(
    self, policy: CommPrecisionPolicy | None, *, recurse: bool = True
) -> None:
    """Quantized communication: what the all-gather and the gradient reduction carry
    for this module's groups (``recurse``: and every FSDP module under it) from the
    next collective on; ``None`` communicates exactly again. Per-group opt-out: call
    it with ``None`` on a submodule after setting it on the root. dtensor_fsdp only:
    not in torch.

    Raises:
        TypeError: ``policy`` is not a ``CommPrecisionPolicy`` or None.
    """
    if policy is not None and not isinstance(policy, CommPrecisionPolicy):
        raise TypeError(
            f"set_comm_precision expects a CommPrecisionPolicy or None, got {policy!r}"
        )
    for group in tree_groups(self, recurse):
        group.set_comm_precision(policy)


def set_custom_all_gather(self, comm: AllGather) -> None:
    """Run this group's all-gathers with ``comm``, which also allocates their output.
    Not recursive. ``comm`` receives 1-D uint8 tensors (the group's shards as bytes)
    and is called with ``async_op=True``; it must return a ``Work``.

    Raises:
        ValueError: the module's call made groups on several meshes, as torch's.
    """
    for group in single_mesh_groups(self, "set_custom_all_gather"):
        group.set_all_gather_comm(comm)


def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
    """Run this group's reduce-scatters with ``comm``, which also allocates their
    output. Not recursive. ``comm`` gets a 1-D input of W equal chunks and
    ``ReduceOp.SUM``; FSDP divides afterwards.

    Raises:
        ValueError: the module's call made groups on several meshes, as torch's.
    """
    for group in single_mesh_groups(self, "set_custom_reduce_scatter"):
        group.reduction.update(strategy=comm)


def set_all_reduce_hook(
    self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
) -> None:
    """Call ``hook(reduce_output)`` on this group's reduced gradients, in place,
    before they land on ``.grad``: the reduce-scatter output (FSDP) or the
    all-reduce output (HSDP), 1-D. Not recursive.

    Args:
        hook: ``hook(reduce_output) -> None``; ``None`` removes it.
        stream: on an accelerator, the stream to run the hook on: it waits for the
            reduction, and the gradients land after the hook. As in torch, it stays
            set until another ``stream`` is given, and is refused for native HSDP
            (there the hook runs where the all-reduce's result is read). On the host
            (CPU, gloo) there are no streams and it changes nothing.

    Raises:
        ValueError: ``stream`` with a 2-D (HSDP) mesh; ``stream`` without a hook
            (also an ``AssertionError``, torch's type, which torch raises at the
            first backward); the module's call made groups on several meshes, as
            torch's.
    """
    groups = single_mesh_groups(self, "set_all_reduce_hook")
    if stream is not None and any(g.mesh_info.is_hsdp for g in groups):
        raise ValueError(
            "stream cannot be set when using native HSDP: the hook runs after the "
            "replicate all-reduce; call set_all_reduce_hook(hook) without stream"
        )
    if stream is not None and hook is None:
        raise SetterError(
            "all reduce hook stream is specified but hook itself is missing: pass the "
            "hook with its stream, or neither"
        )
    for group in groups:
        group.reduction.update(hook=hook)
        if stream is not None:
            group.reduction.all_reduce_hook_stream = stream


def set_reduce_scatter_divide_factor(self, factor: float) -> None:
    set_gradient_divide_factor(self, factor)


def set_gradient_divide_factor(self, factor: float) -> None:
    """Divide reduced gradients by ``factor`` instead of the data-parallel world size
    (e.g. 1.0 when the loss is already a global mean). Not recursive, as torch's:
    torchtitan calls it on every FSDP module."""
    warn_if_graph_mode(self, "set_gradient_divide_factor")
    if factor <= 0:
        raise ValueError(f"gradient divide factor must be positive, got {factor}")
    for group in own_groups(self):
        group.reduction.update(gradient_divide_factor=factor)


def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
    """Only ever ask collectives to SUM (no AVG or PREMUL_SUM), dividing separately.
    Not recursive, as torch's. On gloo this is always the case."""
    warn_if_graph_mode(self, "set_force_sum_reduction_for_comms")
    for group in own_groups(self):
        group.reduction.update(force_sum_reduction=enable)


def set_reduce_scatter_unused_params(
    self, reduce_scatter_unused_params: bool, *, recurse: bool = True
) -> None:
    """Reduce-scatter zeros for trainable parameters that got no gradient, so ranks
    that used different parameters (conditional compute, MoE) still issue the same
    collective. Like DDP's ``find_unused_parameters``."""
    warn_if_graph_mode(self, "set_reduce_scatter_unused_params")
    for group in tree_groups(self, recurse):
        group.reduction.update(reduce_unused=reduce_scatter_unused_params)


def set_separate_reduce_scatter_group(
    self, enable: bool = True, *, recurse: bool = True
) -> None:
    """Run gradient reduce-scatters on a process group of their own (``True``), or
    on the shard group shared with the all-gathers again (``False``).

    One communicator runs one collective at a time, so on the shared group a
    backward all-gather waits for the reduce-scatter issued before it (and vice
    versa); on two groups over the same ranks they can progress concurrently, as
    far as the network allows. As in torch, one new group is created per set of
    shard ranks (``dist.new_group(ranks, use_local_synchronization=True)``) and
    shared by the groups of one call; a group already separate keeps its own. This
    is collective for the shard ranks: call it on every rank, in the same order.
    Any backend (on gloo the reduction is an all-to-all on the new group). HSDP's
    replicate all-reduce keeps its group.

    Args:
        enable: ``True`` gives the reduce-scatters their own process group;
            ``False`` returns them to the shard group.
        recurse: for every FSDP module under this one, or just this one.
    """
    new_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for group in tree_groups(self, recurse):
        group.reduction.set_separate_reduce_scatter_group(enable, new_groups)


def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
    """Allocate this module's all-gather and reduce-scatter buffers with the process
    group's own allocator (``enable=True``), where its backend has one (NCCL's, for
    zero-copy transfers over NVLink SHARP or InfiniBand), else as usual: gloo has
    none, so on the host this changes nothing, as torch's. ``False`` returns to the
    caching allocator. Not recursive. As torch's, it cannot follow a custom
    all-gather or reduce-scatter, nor ``set_symm_mem_for_comm`` (whose strategies
    torch takes for custom ones); graph mode runs these strategies as opaque ops.

    Args:
        enable: whether to allocate from the process group.

    Raises:
        ValueError: this module's all-gather or reduce-scatter is a custom one
            (``set_custom_all_gather``, ``set_custom_reduce_scatter``,
            ``set_symm_mem_for_comm``), which allocates its own buffers; also an
            ``AssertionError``, as in torch.
    """
    groups = own_groups(self)
    method = "set_allocate_memory_from_process_group()"
    _refuse_comms(groups, method, (DefaultAllGather, ProcessGroupAllocAllGather),
                       (DefaultReduceScatter, ProcessGroupAllocReduceScatter))  # fmt: skip
    for group in groups:
        if enable:
            group.set_all_gather_comm(ProcessGroupAllocAllGather(group.mesh_info.shard_group))
            strategy = ProcessGroupAllocReduceScatter(group.reduction.reduce_scatter_group)
        else:
            group.set_all_gather_comm(DefaultAllGather())
            strategy = DefaultReduceScatter()
        group.reduction.update(strategy=strategy)


def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
    """Allocate this module's all-gather buffers (and, with
    ``set_force_sum_reduction_for_comms(True)``, its reduce-scatter buffers) in
    symmetric memory, so that NCCL can run its copy-engine or symmetric-kernel
    all-gather. Not recursive. As torch's: a torch build without symmetric memory
    (a CPU one) raises ``RuntimeError``; it cannot follow a custom all-gather or
    reduce-scatter, nor ``set_allocate_memory_from_process_group_for_comm``. It is a
    collective over each group's ranks (a barrier, as torch's).

    Args:
        backend: the symmetric memory backend: ``"NCCL"`` (torch documents only
            it; ``"CUDA"`` and ``"NVSHMEM"`` are torch's other names).

    Raises:
        ValueError: ``backend`` is none of those (also a ``RuntimeError``, as in
            torch); a custom all-gather or reduce-scatter is set on this module (also
            an ``AssertionError``, as in torch).
        RuntimeError: this torch build has no symmetric memory ``backend``.
    """
    if backend not in _SYMMETRIC_MEMORY_BACKENDS:
        raise SymmetricMemoryBackendError(
            f"SymmetricMemory does not find allocation backend {backend}: pass "
            f"one of {_SYMMETRIC_MEMORY_BACKENDS} (torch's FSDP2 documents 'NCCL')"
        )
    groups = own_groups(self)
    _refuse_comms(groups, "set_symm_mem()", (DefaultAllGather, SymmMemAllGather),
                       (DefaultReduceScatter, SymmMemReduceScatter))  # fmt: skip
    # Every strategy first (on a build without symmetric memory the first raises),
    # then set: nothing half-installed.
    all_gathers = [SymmMemAllGather(g.mesh_info.shard_group, backend) for g in groups]
    reduce_scatters = [
        SymmMemReduceScatter(g.reduction.reduce_scatter_group, backend)
        if g.reduction.force_sum_reduction
        else None
        for g in groups
    ]
    for group, all_gather, reduce_scatter in zip(groups, all_gathers, reduce_scatters):
        group.set_all_gather_comm(all_gather)
        if reduce_scatter is not None:
            group.reduction.update(strategy=reduce_scatter)


def _refuse_comms(
    groups: list[FSDPParamGroup],
    method: str,
    all_gathers: tuple[type, ...],
    reduce_scatters: tuple[type, ...],
) -> None:
    """torch's check: ``method`` may replace only the strategies in its own family."""
    for group in groups:
        for kind, comm, allowed in (
            ("all gather", group.all_gather_comm, all_gathers),
            ("reduce scatter", group.reduction.reduce_scatter_comm, reduce_scatters),
        ):
            if not isinstance(comm, allowed):
                raise SetterError(
                    f"cannot call {method} when {kind} comm is custom: "
                    f"{type(comm).__name__}. A custom {kind} allocates its own buffers"
                )
