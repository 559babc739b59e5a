"""The issue of one group's gradient reduce-scatter, and what finishing it needs.

Post-backward collects the group's unsharded grads (zeros for unused parameters if
asked); the group's `ReductionDescription` (comm_description.py) says how they are
reduced; this issues one reduce-scatter of them, exact or with quantized legs.
"""

import dataclasses

import torch
import torch.distributed as dist

from ..collectives import (
    QuantizedReduceScatterResult,
    ReduceScatterResult,
    finish_quantized_reduce_scatter,
    finish_reduce_scatter,
    quantized_reduce_scatter,
    reduce_scatter,
)
from ..comm_description import ReductionDescription
from ..comm_math import reduction_input
from ..observer import Observers, Watches
from ..param import FSDPParam


@dataclasses.dataclass(frozen=True)
class IssuedReduceScatter:
    """One group's reduce-scatter in flight, and what finishing it needs."""

    result: ReduceScatterResult | QuantizedReduceScatterResult
    params: list[FSDPParam]  # those with a gradient, in the reduced buffer's order
    description: ReductionDescription  # read once: the whole reduction follows it
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


def issue_reduce_scatter(
    grads: list[torch.Tensor],
    description: ReductionDescription,
    group: dist.ProcessGroup,
    residuals: list[torch.Tensor | None] | None,
) -> ReduceScatterResult | QuantizedReduceScatterResult:
    """Issue one reduce-scatter of ``grads`` as ``description`` says: exact, or with the
    quantized legs of its policy (``residuals``: their error feedback, or None). Takes
    ``grads``: the list is emptied once they are copied in (comm_math.py)."""
    if not description.any_quantized:
        reduce_input = reduction_input(
            grads, description.reduce_dtype, group.size(), description.pre_divisor
        )
        return reduce_scatter(
            reduce_input, group, description.ops, description.strategy, async_op=True
        )
    policy = description.policy
    assert policy is not None and policy.reduce_scatter is not None
    return quantized_reduce_scatter(
        grads,
        description.quantized,
        description.reduce_dtype,
        description.pre_divisor,
        group,
        description.ops,
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
