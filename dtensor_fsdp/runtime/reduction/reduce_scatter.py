"""The issue of one group's gradient reduce-scatter, and what finishing it needs.

Post-backward collects the group's unsharded grads (zeros for unused parameters if
asked), picks how they are reduced (`ReductionPlan`, the divisors around the sum) and
issues one reduce-scatter of them, exact or with quantized legs.
"""

import dataclasses

import torch
import torch.distributed as dist

from ...api import CommPrecisionPolicy
from ..collectives import (
    QuantizedReduceScatterResult,
    ReduceScatterResult,
    ReductionPlan,
    copy_in_grads,
    finish_quantized_reduce_scatter,
    finish_reduce_scatter,
    quantized_reduce_scatter,
    reduce_scatter,
)
from ..observer import Observers, Watches
from ..param import FSDPParam
from .landing import NO_OVERFLOW_RISK


@dataclasses.dataclass(frozen=True)
class IssuedReduceScatter:
    """One group's reduce-scatter in flight, and what finishing it needs."""

    result: ReduceScatterResult | QuantizedReduceScatterResult
    params: list[FSDPParam]  # those with a gradient, in the reduced buffer's order
    post_divisor: float
    policy: CommPrecisionPolicy | None  # read once: the whole reduction follows it
    fqn: str  # the group's, for the observers
    observers: Observers  # the group's at the issue: they also see HSDP's all-reduce
    watches: Watches  # the observers' watches of this reduce-scatter
    written_event: object | None  # HSDP: compute's writes before the issue (see there)


def collect_grads(
    fsdp_params: list[FSDPParam], reduce_scatter_unused_params: bool
) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    """The params with a grad to reduce and their grads (in their order), taken from the
    params: the returned list holds the only references, so dropping it frees them."""
    # One call each: for TP, turning a Partial grad into its placements communicates.
    to_reduce = [(p, p.grad_to_reduce()) for p in fsdp_params]
    for fsdp_param in fsdp_params:
        fsdp_param.clear_unsharded_grad()
    if reduce_scatter_unused_params:
        # Every rank must issue the same collective even if some rank left a
        # parameter unused this step (conditional compute, MoE): send zeros.
        to_reduce = [
            (p, p.zero_grad_to_reduce() if g is None and p.requires_grad else g)
            for p, g in to_reduce
        ]
    with_grad = [(p, g) for p, g in to_reduce if g is not None]
    return [p for p, _ in with_grad], [g for _, g in with_grad]


def quantized_plan(
    plan: ReductionPlan, policy: CommPrecisionPolicy | None, is_quantized: list[bool]
) -> ReductionPlan:
    """``plan`` under a policy that quantizes the reduce-scatter: quantized legs sum in
    fp32 after decoding, so no collective averages."""
    if policy is None or policy.reduce_scatter is None:
        return plan
    return dataclasses.replace(
        plan,
        use_all_to_all=plan.use_all_to_all or any(is_quantized),
        average_in_reduce_scatter=plan.average_in_reduce_scatter and not any(is_quantized),
        average_in_all_reduce=False,
    )


def gradient_divisors(
    plan: ReductionPlan,
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
        (1 if plan.average_in_reduce_scatter else shard_size)
        * (1 if plan.average_in_all_reduce else replicate_size)
    )
    if divisor == 1.0 or reduce_dtype in NO_OVERFLOW_RISK:
        return 1.0, divisor
    pre_divisor = 1
    while divisor % pre_divisor == 0 and divisor / pre_divisor > pre_divisor:
        pre_divisor *= 2
    return float(pre_divisor), divisor / pre_divisor


def issue_reduce_scatter(
    grads: list[torch.Tensor],
    is_quantized: list[bool],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    plan: ReductionPlan,
    pre_divisor: float,
    policy: CommPrecisionPolicy | None,
    residuals: list[torch.Tensor | None] | None,
) -> ReduceScatterResult | QuantizedReduceScatterResult:
    """Issue one reduce-scatter of ``grads`` (divided by ``pre_divisor`` first): exact, or
    with the quantized legs of ``policy`` where ``is_quantized`` (``residuals``: their
    error feedback, or None). Takes ``grads``: the list is emptied once they are copied
    in, so they are freed before the collective's output exists (torch frees them at
    the same point)."""
    if not any(is_quantized):
        reduce_input = copy_in_grads(grads, reduce_dtype, group.size())
        grads.clear()
        if pre_divisor != 1.0:
            # In place, as torch's: the same division of the same values as dividing
            # each cast grad before the copy.
            reduce_input.div_(pre_divisor)
        return reduce_scatter(reduce_input, group, plan, async_op=True)
    assert policy is not None and policy.reduce_scatter is not None
    cast = [grad.to(reduce_dtype) for grad in grads]
    grads.clear()
    if pre_divisor != 1.0:
        cast = torch._foreach_div(cast, pre_divisor)
    return quantized_reduce_scatter(
        cast,
        is_quantized,
        reduce_dtype,
        group,
        plan,
        policy.reduce_scatter,
        policy.block_size,
        residuals,
    )


def finish_any_reduce_scatter(
    result: ReduceScatterResult | QuantizedReduceScatterResult,
) -> torch.Tensor:
    """This rank's reduced chunk of every grad, (sum of padded chunk numels,)."""
    if isinstance(result, QuantizedReduceScatterResult):
        return finish_quantized_reduce_scatter(result)
    return finish_reduce_scatter(result)
