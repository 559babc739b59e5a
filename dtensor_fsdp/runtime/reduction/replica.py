"""HSDP's reduction over the replicate axis, after the shard axis's reduce-scatter.

The shard-reduced chunks of a group (plus the partial sums that micro-batches without
all-reduce left, ``set_requires_all_reduce(False)``) are summed over the replicas: one
all-reduce of the exact ones, and for a ``CommPrecisionPolicy`` that quantizes this leg
one all-to-all of the encoded ones (then an all-gather when finishing).
"""

import dataclasses

import torch
import torch.distributed as dist

from ...api import CommPrecisionPolicy
from ..collectives import (
    QuantizedAllReduceResult,
    all_reduce,
    finish_quantized_all_reduce,
    quantized_all_reduce,
)
from ..comm_math import merge_replica_sums, replica_input, split_replica_parts
from ..observer import Watches, begin_wait, end_wait, wait_work
from ..param import FSDPParam


@dataclasses.dataclass(frozen=True)
class ReplicaAllReduce:
    """HSDP's replicate-axis reduction of one group's gradients, in flight."""

    params: list[FSDPParam]  # in the reduced buffer's order
    is_quantized: list[bool]  # per param: on the quantized leg
    exact_numels: list[int]  # per exact param, its chunk's elements
    exact_flat: torch.Tensor | None  # the exact params' chunks, all-reduced in place
    exact_work: dist.Work | None
    quantized: QuantizedAllReduceResult | None
    watches: Watches  # the group's observers' watches of this reduction
    nbytes: int  # bytes this rank sends

    def wait(self) -> None:
        """Wait only (after an exception): the buffers must outlive the collectives."""
        if self.exact_work is not None:
            self.exact_work.wait()
        if self.quantized is not None and self.quantized.work is not None:
            self.quantized.work.wait()


def take_replica_parts(
    group_params: list[FSDPParam], chunks: dict[FSDPParam, torch.Tensor]
) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    """The params to all-reduce (in the group's order) and what each contributes: its
    chunk, plus the partial sum earlier micro-batches left (taken: it is reduced now)."""
    params = [p for p in group_params if p in chunks or p.partial_reduced_grad is not None]
    parts = []
    for fsdp_param in params:
        parts.append(replica_input(chunks.get(fsdp_param), fsdp_param.partial_reduced_grad))
        fsdp_param.partial_reduced_grad = None
    return params, parts


def issue_replica_all_reduce(
    params: list[FSDPParam],
    parts: list[torch.Tensor],
    is_quantized: list[bool],
    group: dist.ProcessGroup,
    average: bool,
    policy: CommPrecisionPolicy | None,
    watches: Watches,
) -> ReplicaAllReduce:
    """Issue the sum of ``parts`` (1-D each) over ``group``: one all-reduce of the exact
    ones, one quantized all-reduce of those ``is_quantized`` marks.

    Args:
        average: the exact all-reduce averages (``ReduceOp.AVG``).
        watches: the group's observers' watches of it (runtime/observer.py).
    """
    exact_flat, exact_numels, quantized = split_replica_parts(parts, is_quantized)
    exact_work, quantized_result = None, None
    nbytes = 0
    if exact_flat is not None:
        exact_work = all_reduce(exact_flat, group, average)
        nbytes += exact_flat.nbytes
    if quantized:
        assert policy is not None and policy.reduce_scatter is not None
        quantized_result = quantized_all_reduce(
            quantized, group, policy.reduce_scatter, policy.block_size
        )
        nbytes += quantized_result.nbytes
    return ReplicaAllReduce(
        params, is_quantized, exact_numels, exact_flat, exact_work,
        quantized_result, watches, nbytes,
    )  # fmt: skip


def finish_replica_all_reduce(pending: ReplicaAllReduce) -> tuple[list[FSDPParam], torch.Tensor]:
    """Wait for the replicate-axis reduction (its watches see the wait); the params and
    their reduced chunks, one 1-D buffer in the params' order."""
    if pending.watches:
        begin_wait(pending.watches)
    exact_flat = pending.exact_flat
    if exact_flat is not None and pending.exact_work is not None:
        wait_work(pending.exact_work, pending.watches)
    quantized: list[torch.Tensor] = []
    if pending.quantized is not None:
        quantized = finish_quantized_all_reduce(pending.quantized)
    if pending.watches:
        end_wait(pending.watches, pending.nbytes, "backward")
    flat = merge_replica_sums(exact_flat, pending.exact_numels, quantized, pending.is_quantized)
    return pending.params, flat  # (sum of padded chunk numels,)
