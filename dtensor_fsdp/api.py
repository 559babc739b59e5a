"""Public configuration types, with the same names and fields as torch.distributed.fsdp.

Everything here is a frozen dataclass (or an abstract interface) so a policy can be shared
between ``fully_shard`` calls without one call's mutation leaking into another.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp | dist.ReduceOp.RedOpType


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for one ``fully_shard`` group.

    Attributes:
        param_dtype: dtype of the unsharded parameters, hence of the all-gather and of
            forward/backward compute. ``None`` keeps the original dtype. The sharded
            parameters the optimizer steps stay in their original dtype.
        reduce_dtype: dtype of the gradient reduction. ``None`` with ``param_dtype`` set
            reduces in ``param_dtype``.
        output_dtype: dtype to cast floating-point forward outputs to. ``None``: no cast.
        cast_forward_inputs: whether to cast floating-point forward inputs to
            ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading. The base class, and the default value of ``offload_policy``."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    Attributes:
        pin_memory: pin the CPU shards so host-device copies can overlap compute.
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Names the data-parallel axes of a full SPMD mesh whose parameters are already
    DTensors on it (torch 2.13's ``dp_mesh_dims``).

    Attributes:
        shard: mesh axis name(s) FSDP shards on; several are flattened into one.
        replicate: mesh axis name(s) HSDP replicates over; several are flattened.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard or replicate")


class Comm(ABC):
    """A collective with its own buffer allocation (torch's ``Comm`` interface)."""

    @abstractmethod
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return an uninitialized buffer of ``size`` for this collective."""


class AllGather(Comm):
    """A user-supplied all-gather: ``output_tensor`` is ``group.size()`` inputs, rank-major."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Comm):
    """A user-supplied reduce-scatter: ``output_tensor`` gets this rank's reduced chunk."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None: ...
