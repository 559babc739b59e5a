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
        chunk, partial = chunks.get(fsdp_param), fsdp_param.partial_reduced_grad
        parts.append(chunk if partial is None else partial if chunk is None else partial + chunk)
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
    exact = [t for t, q in zip(parts, is_quantized, strict=True) if not q]
    quantized = [t for t, q in zip(parts, is_quantized, strict=True) if q]
    exact_flat, exact_work, quantized_result = None, None, None
    nbytes = 0
    if exact:
        exact_flat = torch.cat(exact)  # (exact padded chunk numels,)
        exact_work = all_reduce(exact_flat, group, average)
        nbytes += exact_flat.nbytes
    if quantized:
        assert policy is not None and policy.reduce_scatter is not None
        quantized_result = quantized_all_reduce(
            quantized, group, policy.reduce_scatter, policy.block_size
        )
        nbytes += quantized_result.nbytes
    return ReplicaAllReduce(
        params, is_quantized, [t.numel() for t in exact], exact_flat, exact_work,
        quantized_result, watches, nbytes,
    )  # fmt: skip


def finish_replica_all_reduce(pending: ReplicaAllReduce) -> tuple[list[FSDPParam], torch.Tensor]:
    """Wait for the replicate-axis reduction (its watches see the wait); the params and
    their reduced chunks, one 1-D buffer in the params' order."""
    if pending.watches:
        begin_wait(pending.watches)
    exact: list[torch.Tensor] = []
    if pending.exact_flat is not None:
        if pending.exact_work is not None:
            wait_work(pending.exact_work, pending.watches)
        exact = list(pending.exact_flat.split(pending.exact_numels))
    quantized: list[torch.Tensor] = []
    if pending.quantized is not None:
        quantized = finish_quantized_all_reduce(pending.quantized)
    if pending.watches:
        end_wait(pending.watches, pending.nbytes, "backward")
    exact_iter, quantized_iter = iter(exact), iter(quantized)
    flat = torch.cat(
        [next(quantized_iter) if q else next(exact_iter) for q in pending.is_quantized]
    )  # (sum of padded chunk numels,)
    return pending.params, flat
