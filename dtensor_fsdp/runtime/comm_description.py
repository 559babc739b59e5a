"""GroupComm: the one description of a group's communication, and its builders.

[Note: one description, two executors]
What a group's collectives carry and how is decided once, here, and described in
frozen dataclasses of constants (shapes, dtypes, splits, divisors, wire formats,
strategies): `AllGatherDescription` (built with each `AllGatherLayout`, when the group's
parameters, sharded buffer, ``CommPrecisionPolicy`` or all-gather strategy change) and
`ReductionDescription` (built per reduction from the ``FSDPModule.set_*`` settings).
Two executors run a description: the eager runtime (all_gather_layout.py,
collectives.py, reduction/: c10d, streams, observers) and graph mode (graph/gather.py:
functional collectives inside compiled graphs). Between the collectives both call the
same arithmetic (comm_math.py), so they give the same bits
(tests/graph/test_conformance.py runs both over a table of descriptions).

A new collective, wire format or strategy is described here and computed in
comm_math.py; each executor then issues it in its own way (docs/architecture.md, "A new
collective").
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import AllGather, CommPrecisionPolicy, ReduceScatter
from ..comm_precision.wire_format import WireLayout
from .comm_strategies import is_custom
from .mesh import backend_for
from .param import FSDPParam
from .shard_geometry import ShardGeometry

# Reduce dtypes whose range lets the collective sum before dividing.
NO_OVERFLOW_RISK = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class ParamComm:
    """One parameter's part of its group's collectives."""

    fqn: str
    geometry: ShardGeometry
    dtype: torch.dtype  # the sharded param's: its sharded grad lands in it
    param_dtype: torch.dtype  # the all-gather's and the unsharded param's
    reduce_dtype: torch.dtype
    has_extension: bool  # an all-gather extension decides what it sends (extension.py)

    @staticmethod
    def of(fsdp_param: FSDPParam) -> "ParamComm":
        return ParamComm(
            fsdp_param.fqn,
            fsdp_param.geometry,
            fsdp_param.dtype,
            fsdp_param.param_dtype,
            fsdp_param.reduce_dtype,
            fsdp_param.extension is not None,
        )


# All-gather #


@dataclass(frozen=True)
class AllGatherDescription:
    """What one group's all-gather sends, in which order and by which strategy.

    Each rank's bytes: the plain params' padded shards in ``param_dtype`` (largest
    first, so every cast writes an aligned view), then each extension's inputs, then
    the encoded columns (``CommPrecisionPolicy.all_gather``). Indices point into
    ``params``, the group's params in the sharded buffer's order.
    """

    params: tuple[ParamComm, ...]
    plain_order: tuple[int, ...]  # copied exactly
    plain_split: tuple[int, ...]  # their bytes per rank
    plain_dtypes: tuple[torch.dtype, ...]  # their wire dtypes (param_dtype)
    quantized_order: tuple[int, ...]  # encoded at the end (``wire``)
    wire: WireLayout | None
    extension_order: tuple[int, ...]
    # Mixed precision's usual case, one dtype cast to one param_dtype and nothing else:
    # the all-gather input is the whole sharded buffer cast in one op (its order is then
    # the all-gather order; padding casts to zeros).
    casts_whole_buffer: bool
    copies_in: bool  # else the all-gather reads the sharded buffer in place
    offload: bool  # the sharded buffer lives on the host (CPU offload)
    strategy: AllGather

    @property
    def all_gather_order(self) -> tuple[int, ...]:
        """The exactly copied columns of a full all-gather: plain, then extensions."""
        return self.plain_order + self.extension_order

    @property
    def post_forward_order(self) -> tuple[int, ...]:
        """hpZ re-gathers every plain param exactly (no extension: fully_shard refuses
        it), quantized or not, as unsharded bytes."""
        return self.plain_order + self.quantized_order

    @property
    def finishes_copy_out(self) -> tuple[int, ...]:
        """The params with something to do after the copy-out: an extension's
        ``fsdp_post_all_gather``, a ``Shard(dim != 0)`` concatenation."""
        return tuple(
            i for i, p in enumerate(self.params) if p.has_extension or p.geometry.dim != 0
        )

    @property
    def nbytes(self) -> int:
        """Bytes each rank's plain and encoded columns send (extensions' inputs are
        known only at the all-gather)."""
        return sum(self.plain_split) + (self.wire.nbytes if self.wire is not None else 0)


def quantizes_all_gather(policy: CommPrecisionPolicy | None, fsdp_param: FSDPParam) -> bool:
    """Whether ``policy`` sends ``fsdp_param`` encoded in the all-gather."""
    return (
        policy is not None
        and policy.all_gather is not None
        and fsdp_param.extension is None
        and fsdp_param.param_dtype.is_floating_point
        and policy.param_filter(fsdp_param.fqn, fsdp_param.sharded_param)
    )


def describe_all_gather(
    params: Sequence[FSDPParam],
    comm_precision: CommPrecisionPolicy | None,
    strategy: AllGather,
    offload: bool,
) -> AllGatherDescription:
    """The all-gather of ``params`` (the group's, in the sharded buffer's order)."""
    plain = [i for i, p in enumerate(params) if p.extension is None]
    quantized = tuple(i for i in plain if quantizes_all_gather(comm_precision, params[i]))
    plain_order = tuple(
        sorted((i for i in plain if i not in quantized), key=lambda i: -params[i].param_dtype.itemsize)
    )
    extended = tuple(i for i, p in enumerate(params) if p.extension is not None)
    casts = any(params[i].param_dtype != params[i].dtype for i in plain)
    wire = (
        WireLayout(
            comm_precision.all_gather,
            comm_precision.block_size,
            tuple(params[i].padded_shard_numel for i in quantized),
        )
        if quantized and comm_precision is not None and comm_precision.all_gather is not None
        else None
    )
    return AllGatherDescription(
        params=tuple(ParamComm.of(p) for p in params),
        plain_order=plain_order,
        plain_split=tuple(params[i].all_gather_nbytes for i in plain_order),
        plain_dtypes=tuple(params[i].param_dtype for i in plain_order),
        quantized_order=quantized,
        wire=wire,
        extension_order=extended,
        casts_whole_buffer=(
            casts
            and not extended
            and not quantized
            and len({(params[i].dtype, params[i].param_dtype) for i in plain}) == 1
        ),
        copies_in=casts or bool(extended) or bool(quantized),
        offload=offload,
        strategy=strategy,
    )


# Gradient reduction #


@dataclass(frozen=True)
class ReductionOps:
    """Which collectives reduce a group's gradients, and which of them average."""

    use_all_to_all: bool  # gloo: all-to-all then a local sum
    average_in_reduce_scatter: bool  # the reduce-scatter uses ReduceOp.AVG; else SUM
    average_in_all_reduce: bool = False  # HSDP: the replicate all-reduce uses AVG
    # A user's set_custom_reduce_scatter: it gets SUM, and FSDP divides afterwards.
    custom: ReduceScatter | None = None

    @staticmethod
    def choose(
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        prefer_average: bool,
        custom: ReduceScatter | None,
    ) -> "ReductionOps":
        """Picked from the backend that serves the gradients' device
        (``ProcessGroup._get_backend(device)``), never from the backend's name:
        ``init_process_group()`` reports ``"undefined"``, and ``"cuda:nccl,cpu:gloo"``
        names two backends (collectives.py says why each backend gets what it gets).

        Args:
            shard_group: the reduce-scatter's group; ``replicate_group`` HSDP's all-reduce's.
            device: where the gradients are reduced; its backend decides.
            prefer_average: let the collectives average, where they do that well.
            custom: a user ``ReduceScatter``; it gets SUM, and FSDP divides afterwards.
        """
        if custom is not None:
            return ReductionOps(
                use_all_to_all=False, average_in_reduce_scatter=False, custom=custom
            )
        return ReductionOps(
            use_all_to_all=_is_backend(backend_for(shard_group, device), "ProcessGroupGloo"),
            average_in_reduce_scatter=prefer_average and _averages_well(shard_group, device),
            average_in_all_reduce=prefer_average and _averages_well(replicate_group, device),
        )


def _averages_well(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """``ReduceOp.AVG`` on ``group``: NCCL only, and never over one rank (NCCL's AVG can
    be wrong at world size 1; torch's FSDP2 avoids it too)."""
    return (
        group is not None
        and group.size() > 1
        and _is_backend(backend_for(group, device), "ProcessGroupNCCL")
    )


def _is_backend(backend: object | None, class_name: str) -> bool:
    # A CPU-only torch build has no ProcessGroupNCCL class at all.
    cls = getattr(dist, class_name, None)
    return cls is not None and isinstance(backend, cls)


def quantized_ops(
    ops: ReductionOps, policy: CommPrecisionPolicy | None, is_quantized: Sequence[bool]
) -> ReductionOps:
    """``ops`` under a policy that quantizes the reduce-scatter: quantized legs sum in
    fp32 after decoding, so no collective averages."""
    if policy is None or policy.reduce_scatter is None:
        return ops
    return dataclasses.replace(
        ops,
        use_all_to_all=ops.use_all_to_all or any(is_quantized),
        average_in_reduce_scatter=ops.average_in_reduce_scatter and not any(is_quantized),
        average_in_all_reduce=False,
    )


def gradient_divisors(
    ops: ReductionOps,
    reduce_dtype: torch.dtype,
    divide_factor: float | None,
    shard_size: int,
    replicate_size: int,
) -> tuple[float, float]:
    """(before, after) the reduction: the gradient average over every data-parallel
    rank, or ``set_gradient_divide_factor``'s factor, less the axes whose collective
    averages. Other dtypes than fp32/bf16 (fp16's range is small) split it around the
    sum, about sqrt each side, so the sum cannot overflow: torch's power-of-two split,
    so the rounding is torch's too."""
    divisor = divide_factor or float(
        (1 if ops.average_in_reduce_scatter else shard_size)
        * (1 if ops.average_in_all_reduce else replicate_size)
    )
    if divisor == 1.0 or reduce_dtype in NO_OVERFLOW_RISK:
        return 1.0, divisor
    pre_divisor = 1
    while divisor % pre_divisor == 0 and divisor / pre_divisor > pre_divisor:
        pre_divisor *= 2
    return float(pre_divisor), divisor / pre_divisor


@dataclass(frozen=True)
class ReductionDescription:
    """How one reduction of a group's gradients runs, for ``params`` in this order:
    one reduce-scatter over the shard axis (exact, or with quantized legs), HSDP's
    all-reduce over the replicate axis, the divisions, the user's hook, and where the
    sharded gradients land."""

    params: tuple[ParamComm, ...]
    ops: ReductionOps
    # Calls the reduce-scatter where ``ops`` reduce-scatter (custom, or a built-in:
    # comm_strategies.py); allocates the all-to-all's output where it does not.
    strategy: ReduceScatter
    reduce_dtype: torch.dtype
    pre_divisor: float
    post_divisor: float
    # torch divides inside the collective (AVG, PREMUL_SUM) for fp32/bf16 unless sums
    # are forced: the hook then sees divided gradients, otherwise the sums.
    divided_in_collective: bool
    policy: CommPrecisionPolicy | None  # read once: the whole reduction follows it
    quantized: tuple[bool, ...]  # per param: encoded on the shard-axis leg
    replicate_quantized: tuple[bool, ...]  # per param: encoded on HSDP's replicate leg
    error_feedback: bool  # quantized params keep their residuals (error_feedback.py)
    all_reduce: bool  # HSDP and set_requires_all_reduce(True): reduce over replicas now
    hook: Callable[[torch.Tensor], None] | None  # set_all_reduce_hook
    offload: bool  # the sharded grads land on the host (CPU offload)
    reduce_unused: bool  # set_reduce_scatter_unused_params: unused params reduce zeros

    @property
    def any_quantized(self) -> bool:
        return any(self.quantized)


@dataclass(frozen=True)
class ReductionSettings:
    """The ``FSDPModule.set_*`` settings a reduction is described from, with the
    group's mesh (`describe_reduction`'s input, read by GradientReduction)."""

    shard_group: dist.ProcessGroup  # the reduce-scatter's (set_separate_reduce_scatter_group)
    replicate_group: dist.ProcessGroup | None  # HSDP's
    shard_size: int
    replicate_size: int
    device: torch.device
    gradient_divide_factor: float | None
    force_sum_reduction: bool
    strategy: ReduceScatter
    policy: CommPrecisionPolicy | None
    requires_all_reduce: bool
    hook: Callable[[torch.Tensor], None] | None
    offload: bool
    reduce_unused: bool


def quantizes_reduction(
    policy: CommPrecisionPolicy | None,
    fsdp_param: FSDPParam,
    *,
    replicate_leg: bool,
    strategy: ReduceScatter | None = None,
    shard_size: int = 1,
) -> bool:
    """Whether ``fsdp_param``'s gradient travels encoded on the shard-axis
    reduce-scatter (over ``shard_size`` ranks, by ``strategy``), or with
    ``replicate_leg`` on HSDP's replicate all-reduce."""
    return (
        policy is not None
        and policy.reduce_scatter is not None
        and (
            replicate_leg
            or (
                not policy.replicate_only
                and not (strategy is not None and is_custom(strategy))
                and shard_size > 1  # one rank: nothing on the wire
            )
        )
        and fsdp_param.reduce_dtype.is_floating_point
        and policy.param_filter(fsdp_param.fqn, fsdp_param.sharded_param)
    )


def describe_reduction(
    settings: ReductionSettings, params: Sequence[FSDPParam]
) -> ReductionDescription:
    """The reduction of ``params``' gradients (all of one reduce dtype) under
    ``settings``."""
    reduce_dtype = params[0].reduce_dtype
    policy = settings.policy
    strategy = settings.strategy
    ops = ReductionOps.choose(
        settings.shard_group,
        settings.replicate_group,
        settings.device,
        # fp16 could overflow while the collective sums: it pre-divides instead.
        prefer_average=settings.gradient_divide_factor is None
        and not settings.force_sum_reduction
        and reduce_dtype in NO_OVERFLOW_RISK,
        custom=strategy if is_custom(strategy) else None,
    )
    quantized = (False,) * len(params)
    if policy is not None and policy.reduce_scatter is not None:
        quantized = tuple(
            quantizes_reduction(
                policy, p, replicate_leg=False, strategy=strategy, shard_size=settings.shard_size
            )
            for p in params
        )
    ops = quantized_ops(ops, policy, quantized)
    pre_divisor, post_divisor = gradient_divisors(
        ops,
        reduce_dtype,
        settings.gradient_divide_factor,
        settings.shard_size,
        settings.replicate_size,
    )
    is_hsdp = settings.replicate_group is not None
    return ReductionDescription(
        params=tuple(ParamComm.of(p) for p in params),
        ops=ops,
        strategy=strategy,
        reduce_dtype=reduce_dtype,
        pre_divisor=pre_divisor,
        post_divisor=post_divisor,
        divided_in_collective=not settings.force_sum_reduction and reduce_dtype in NO_OVERFLOW_RISK,
        policy=policy,
        quantized=quantized,
        replicate_quantized=tuple(
            is_hsdp and quantizes_reduction(policy, p, replicate_leg=True) for p in params
        ),
        error_feedback=policy is not None and policy.error_feedback and any(quantized),
        all_reduce=is_hsdp and settings.requires_all_reduce,
        hook=settings.hook,
        offload=settings.offload,
        reduce_unused=settings.reduce_unused,
    )


@dataclass(frozen=True)
class GroupComm:
    """A group's communication: its all-gather and the reduction of its trainable
    params' gradients. Graph mode executes it whole (graph/gather.py); the eager
    runtime its halves where they are built. See [Note: one description, two
    executors]."""

    all_gather: AllGatherDescription
    reduction: ReductionDescription | None  # None: nothing to reduce (all frozen)
    group_name: str  # the shard axis' process group
    world_size: int
    reduce_group_name: str  # the reduce-scatter's (set_separate_reduce_scatter_group)
    replicate_group_name: str | None  # HSDP's replicate axis
    replicate_size: int
