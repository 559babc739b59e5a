"""Public configuration types, with the same names and fields as torch.distributed.fsdp.

Everything here is a frozen dataclass (or an abstract interface) so a policy can be shared
between ``fully_shard`` calls without one call's mutation leaking into another.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class FSDPGroupInfo:
    """One parameter group of a ``fully_shard`` call, as ``FSDPModule.describe_groups``
    reports it: the parameters that are all-gathered and reduce-scattered together (one
    per call, or one per mesh when ``shard_placement_fn`` puts parameters on several).
    Read-only: changing it changes nothing. dtensor_fsdp only: not in torch.

    Attributes:
        fqn: the group's name in ``CommTrace`` events and error messages: the path of
            the call's first module from the root (``""`` for the root, and for every
            group before the root's first forward or ``set_comm_trace``); a call on
            several meshes adds the mesh axes (``"layers.0 [shard]"``).
        modules: the modules passed to the ``fully_shard`` call.
        numel: the group's parameters' elements, unsharded and unpadded (the sum of
            their DTensors' ``numel()``).
        unsharded_nbytes: the bytes its all-gather outputs on each rank, which the
            unsharded parameters occupy: every rank's padded shard, in
            ``MixedPrecisionPolicy.param_dtype`` (each parameter's dtype without one).
        shard_size: the ranks its parameters are sharded over.
        replicate_size: HSDP's replicas (1 without HSDP).
        reshard_after_forward: as ``fully_shard`` took it, resolved: ``True``/``False``,
            or the smaller world size the parameters reshard to after forward (an int).
    """

    fqn: str
    modules: tuple[torch.nn.Module, ...]
    numel: int
    unsharded_nbytes: int
    shard_size: int
    replicate_size: int
    reshard_after_forward: bool | int


def _is_matrix(fqn: str, param: torch.nn.Parameter) -> bool:
    """The default `CommPrecisionPolicy.param_filter`: weight matrices (and embeddings)
    are quantized; norms, biases and other 1-D params stay exact: they are a sliver of the
    bytes, and their values (a gain near 1, small offsets) do not share a scale well."""
    return param.ndim >= 2


@dataclass(frozen=True)
class CommPrecisionPolicy:
    """What the wire carries, per direction: quantized communication (ZeRO++'s qwZ and
    qgZ) without subclassing the model. dtensor_fsdp only: not in torch.

    Sharded params, their grads and the optimizer state keep their dtype; only the bytes
    of the collectives change. Every rank dequantizes the same gathered bytes (its own
    shard included), so all ranks compute with identical weights. Set it with
    ``FSDPModule.set_comm_precision``; its cost is accuracy (see README, "Quantized
    communication").

    Attributes:
        all_gather: the all-gather wire format of the selected params: ``"bf16"``,
            ``"int8"`` or ``"fp8_e4m3"`` (block-wise scales carried in the same buffer);
            ``None`` all-gathers them exactly (in ``MixedPrecisionPolicy.param_dtype``).
        reduce_scatter: the gradients' wire format: ``"bf16"`` or ``"int8"`` (block-wise),
            sent by one all-to-all and summed in fp32 after dequantization, never in the
            low precision; ``None`` reduces exactly.
        block_size: elements per quantization block (a positive multiple of 4); the scales
            cost 4 bytes per block. Smaller blocks track magnitudes better
            (``python tools/quant_error.py`` prints the error per block size).
        error_feedback: keep each rank's gradient quantization error and add it to the next
            step's gradient before quantizing (error compensation), so the error does not
            accumulate in the weights. Covers the shard-axis reduce-scatter (not HSDP's
            replicate leg). Costs one fp32 buffer of the unsharded gradient size per
            quantized param per rank. The error of a non-finite block is dropped. State
            dicts (hence checkpoints) carry the buffers (README, "Quantized
            communication"): set the policy before loading.
        replicate_only: HSDP: quantize only the all-reduce over the replicate axis (the
            inter-node leg) with ``reduce_scatter``'s format; the shard-axis all-gather
            and reduce-scatter stay exact. ``all_gather`` must then be ``None``.
        param_filter: ``(fqn, param) -> bool``: which params are quantized (in every
            leg, HSDP's replicate all-reduce included); the rest are communicated
            exactly. ``fqn`` is relative to the module passed to that ``fully_shard``
            call; ``param`` is the sharded param. Default: params with 2 or more dims.
    """

    all_gather: str | None = None
    reduce_scatter: str | None = None
    block_size: int = 256
    error_feedback: bool = False
    replicate_only: bool = False
    param_filter: Callable[[str, torch.nn.Parameter], bool] = _is_matrix

    def __post_init__(self) -> None:
        if self.all_gather not in (None, "bf16", "int8", "fp8_e4m3"):
            raise ValueError(
                "CommPrecisionPolicy.all_gather must be None, 'bf16', 'int8' or 'fp8_e4m3', "
                f"got {self.all_gather!r}"
            )
        if self.reduce_scatter not in (None, "bf16", "int8"):
            raise ValueError(
                "CommPrecisionPolicy.reduce_scatter must be None, 'bf16' or 'int8', "
                f"got {self.reduce_scatter!r}"
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(
                f"CommPrecisionPolicy.block_size must be an int, got {self.block_size!r}"
            )
        if self.block_size <= 0 or self.block_size % 4:
            raise ValueError(
                "CommPrecisionPolicy.block_size must be a positive multiple of 4, "
                f"got {self.block_size}"
            )
        if self.error_feedback and (self.reduce_scatter is None or self.replicate_only):
            raise ValueError(
                "CommPrecisionPolicy: error_feedback applies to the shard-axis reduce-scatter: "
                "it needs a reduce_scatter format and replicate_only=False"
            )
        if self.replicate_only and (self.all_gather is not None or self.reduce_scatter is None):
            raise ValueError(
                "CommPrecisionPolicy(replicate_only=True) quantizes only HSDP's replicate "
                "all-reduce: set reduce_scatter (its format) and leave all_gather None"
            )
