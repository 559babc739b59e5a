"""Graph mode's executor of a group's `GroupComm`: its all-gather and its gradient
reduction as traceable ops.

One autograd function per gather, `GroupGather`: its forward builds the all-gather
input from the local shards, all-gathers it and copies it out into the unsharded
parameters; its backward reduces their gradients and cuts them into sharded ones. The
arithmetic between the collectives is the eager runtime's own (runtime/comm_math.py),
in its order, and the collectives are functional ones (graph/collectives.py), so that
without fusion the results are bitwise eager's ([Note: one description, two
executors], runtime/comm_description.py). Everything it needs is in a frozen
`GatherPlan` (constants for dynamo) and the tensors passed in: nothing here reads
module state.
"""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from ..runtime.comm_description import GroupComm, ReductionDescription
from ..runtime.comm_math import (
    AllGatherInput,
    arrange_for_reduce_scatter,
    concat_along_shard_dim,
    copy_in,
    copy_in_grads,
    copy_out,
    decode_columns,
    decoded_sums,
    divide_,
    encoded_partial_sum,
    finish_reduced,
    merge_replica_sums,
    pad_shard,
    quantized_send_rows,
    quantized_sum_rows,
    sharded_grads,
    split_replica_parts,
    sum_all_to_all,
    sum_quantized_rows,
    unsharded_of,
)
from ..runtime.profiler_labels import label
from . import collectives


# The graph nodes of a gather that backward computes again (reshard_after_forward)
# carry this custom annotation (``torch.fx.traceback.annotate``); `backend.mark_reshard`
# makes them ``MUST_RECOMPUTE``.
RESHARD_ANNOTATION = {"dtensor_fsdp": "reshard_after_forward"}


@dataclass(frozen=True)
class PostForwardGroups:
    """hpZ (``reshard_after_forward=k``): the forward all-gathers in two stages, first
    over ``across`` (the W/k ranks at this rank's place in each block of k consecutive
    ranks), then over ``block`` (this rank's block: eager's post-forward group). The
    first stage's output, this rank's 1/k of the unsharded bytes, is what backward
    keeps; the second is computed again in backward over ``block`` alone, as eager's
    backward all-gathers the post-forward buffer over the smaller mesh."""

    across: str
    across_size: int
    block: str
    block_size: int


@dataclass(frozen=True)
class GatherPlan:
    """A group's `GroupComm` with what graph mode adds: the custom ops' names of its
    strategies and hook (graph/collectives.py), where its tensors live, and what
    backward keeps of its all-gather."""

    comm: GroupComm
    all_gather_op: str | None  # None: the default all-gather, a functional collective
    reduce_scatter_op: str | None  # None: the default reduce-scatter
    hook_op: str | None  # set_all_reduce_hook
    trainable: tuple[bool, ...]  # per param of the all-gather: its gradient is reduced
    device: torch.device  # the compute device (the mesh's)
    sharded_device: torch.device  # where the sharded params live (CPU offload: the host)
    reshard: bool  # backward gathers again (reshard_after_forward): nothing is kept
    post_forward: PostForwardGroups | None  # hpZ: backward keeps 1/k and gathers over k
    fqn: str  # the FSDP group's, for its profiler labels

    @property
    def all_gather_nbytes(self) -> int:
        """The unsharded (padded) bytes the forward's all-gather returns."""
        return self.comm.world_size * self.comm.all_gather.nbytes


@dataclass(frozen=True)
class StepInputs:
    """What one forward's gather reads besides the local shards: the settings eager
    reads per backward, and the sums earlier micro-batches left.

    Gradient accumulation without sync (``sync=False``): nothing is reduced; the
    unsharded gradients, in the reduce dtype and rank-major as the reduction takes them
    ((W, sum of the trainable padded local numels)), become the gradient of
    ``accumulator`` (a leaf: autograd sums them over the micro-batches, as eager sums
    its unsharded grads); the syncing micro-batch passes that sum as ``pending``, added
    before the reduction, in eager's order. HSDP without all-reduce (``all_reduce=False``)
    likewise: the shard-reduced chunks become the gradient of ``partial``, and the
    micro-batch that all-reduces adds ``pending_partial`` first, as eager does.
    """

    sync: bool
    all_reduce: bool
    accumulator: torch.Tensor | None
    pending: torch.Tensor | None
    partial: torch.Tensor | None
    pending_partial: torch.Tensor | None
    residuals: tuple[torch.Tensor | None, ...]  # error feedback, per reduced param


def gather(plan: GatherPlan, locals_: list[torch.Tensor], step: StepInputs) -> tuple[torch.Tensor, ...]:
    """The unsharded parameters of the local shards ``locals_`` (in the all-gather's
    param order); the gradients of the trainable ones come back reduced and sharded
    (frozen ones get none, as in eager: not computed, not reduced)."""
    # Kept in the graph only if dynamo is told to (capture_profiler_record_function):
    # see [Note: profiler labels] (runtime/profiler_labels.py).
    with record_function(label("all_gather", plan.fqn)):
        if not torch.is_grad_enabled() or not any(plan.trainable):
            return all_gather(plan, locals_)  # nothing to differentiate: no autograd node
        residuals = [r for r in step.residuals if r is not None]
        return GroupGather.apply(
            plan, step.sync, step.all_reduce, step.accumulator, step.pending, step.partial,
            step.pending_partial, len(residuals), *residuals, *locals_,
        )  # fmt: skip


def all_gather(plan: GatherPlan, locals_: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward: the all-gather input (comm_math.copy_in: every rank's bytes as
    eager's), one all-gather (hpZ: two stages), the copy-out into each unsharded
    parameter. The part backward computes again is annotated (`RESHARD_ANNOTATION`)."""
    comm = plan.comm
    world_size = comm.world_size
    stages = plan.post_forward
    if stages is not None:
        copied_in = _copy_in(plan, locals_)
        kept = collectives.all_gather(
            copied_in.input, plan.all_gather_op, stages.across_size, stages.across
        )  # (W/k * bytes): ranks q, q + k, q + 2k... for this rank's place q
        with _recomputed(True):
            gathered = collectives.all_gather(
                kept, plan.all_gather_op, stages.block_size, stages.block
            )  # (k * W/k * bytes): place-major
            # Rank order: rank b * k + q is row (q, b) of the gathered bytes.
            output = gathered.view(stages.block_size, stages.across_size, -1).transpose(0, 1)
            return _copy_out(plan, output.reshape(-1), copied_in.split_nbytes)
    with _recomputed(plan.reshard):
        copied_in = _copy_in(plan, locals_)
        output = copied_in.input
        if world_size > 1:
            output = collectives.all_gather(output, plan.all_gather_op, world_size, comm.group_name)
        return _copy_out(plan, output, copied_in.split_nbytes)


def _recomputed(recomputed: bool) -> contextlib.AbstractContextManager:
    return torch.fx.traceback.annotate(RESHARD_ANNOTATION) if recomputed else contextlib.nullcontext()


def _copy_in(plan: GatherPlan, locals_: list[torch.Tensor]) -> AllGatherInput:
    """This rank's all-gather input, from its local shards (moved to the compute
    device under CPU offload, padded as in the sharded buffer)."""
    description = plan.comm.all_gather
    shards = [
        pad_shard(local.to(plan.device) if plan.sharded_device != plan.device else local, p.geometry)
        for local, p in zip(locals_, description.params, strict=True)
    ]  # each (*padded_local_shape)
    return copy_in(
        [shards[i] for i in description.plain_order],
        description.plain_dtypes,
        [],
        description.wire,
        [shards[i].reshape(1, -1) for i in description.quantized_order],
    )


def _copy_out(
    plan: GatherPlan, output: torch.Tensor, split_nbytes: list[int]
) -> tuple[torch.Tensor, ...]:
    """The unsharded params from the all-gather ``output`` (W * bytes per rank,)."""
    description = plan.comm.all_gather
    params = description.params
    world_size = plan.comm.world_size
    rows = output.view(world_size, -1)  # (W, bytes per rank)
    exact_nbytes = sum(split_nbytes)
    columns = [
        torch.empty((world_size, nbytes), dtype=torch.uint8, device=output.device)
        for nbytes in split_nbytes
    ]
    copy_out(rows[:, :exact_nbytes], split_nbytes, columns)
    unsharded: list[torch.Tensor | None] = [None] * len(params)
    for i, column in zip(description.plain_order, columns, strict=True):
        unsharded[i] = _unsharded(column, params[i].geometry, params[i].param_dtype)
    if description.wire is not None:
        decoded = [
            torch.empty(
                (world_size, params[i].geometry.padded_shard_numel),
                dtype=params[i].param_dtype,
                device=output.device,
            )
            for i in description.quantized_order
        ]
        decode_columns(rows[:, exact_nbytes:], description.wire, decoded)
        for i, values in zip(description.quantized_order, decoded, strict=True):
            unsharded[i] = _unsharded(
                values.view(torch.uint8), params[i].geometry, params[i].param_dtype
            )
    return tuple(t for t in unsharded if t is not None)


def _unsharded(column: torch.Tensor, geometry: Any, dtype: torch.dtype) -> torch.Tensor:
    """A param's all-gather column ((W, bytes) uint8: W padded shards) as the unsharded
    param, as eager's copy-out and `FSDPParam.finish_copy_out` make it."""
    if geometry.dim != 0:
        return concat_along_shard_dim(column, geometry, dtype, out=None)
    return unsharded_of(column.view(dtype).view(geometry.padded_unsharded_shape), geometry)


class GroupGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        plan: GatherPlan,
        sync: bool,
        all_reduce: bool,
        accumulator: torch.Tensor | None,
        pending: torch.Tensor | None,
        partial: torch.Tensor | None,
        pending_partial: torch.Tensor | None,
        num_residuals: int,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.sync = sync
        ctx.all_reduce = all_reduce
        ctx.num_residuals = num_residuals
        # Error feedback's residuals are replaced in place in backward, as eager's.
        ctx.save_for_backward(pending, pending_partial, *tensors[:num_residuals])
        # A parameter the forward leaves unused gets no gradient (None), as in eager.
        ctx.set_materialize_grads(False)
        outputs = all_gather(plan, list(tensors[num_residuals:]))
        ctx.mark_non_differentiable(
            *(out for out, trainable in zip(outputs, plan.trainable) if not trainable)
        )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: GatherPlan = ctx.plan
        pending, pending_partial, *residuals = ctx.saved_tensors
        none = (None,) * (8 + ctx.num_residuals)
        reduction = plan.comm.reduction
        assert reduction is not None  # some output is trainable
        reduce_input = _reduce_input(plan, reduction, grads, pending)
        if not ctx.sync:
            return (*none[:3], reduce_input, *none[4:], *(None,) * len(grads))
        with record_function(label("post_backward_reduce", plan.fqn)):
            reduced = reduce(plan, reduce_input, residuals, ctx.all_reduce, pending_partial)
        if reduced.partial is not None:
            return (*none[:5], reduced.partial, *none[6:], *(None,) * len(grads))
        assert reduced.reduced is not None
        return (*none, *sharded_grads_of(plan, reduced.reduced, grads))


@dataclass(frozen=True)
class Reduced:
    """A reduction's result: the reduced buffer, or for HSDP without all-reduce the
    shard-reduced partial sum kept for a later micro-batch."""

    reduced: torch.Tensor | None  # (sum of trainable padded numels,), divided later
    partial: torch.Tensor | None


def reduce(
    plan: GatherPlan,
    reduce_input: torch.Tensor,
    residuals: list[torch.Tensor],
    all_reduce: bool,
    pending_partial: torch.Tensor | None,
) -> Reduced:
    """The reduction of ``reduce_input`` ((W, n): `_reduce_input`'s) over the shard
    axis, then for HSDP over the replicas (or, without all-reduce, kept as a partial
    sum), as eager's GradientReduction runs it."""
    reduction = plan.comm.reduction
    assert reduction is not None
    reduced = _reduce_scatter(plan, reduction, reduce_input, residuals)
    if plan.comm.replicate_group_name is None:
        return Reduced(reduced, None)
    if pending_partial is not None:
        reduced = pending_partial + reduced  # eager's order: the partial sum first
    if not all_reduce:
        return Reduced(None, reduced)
    return Reduced(_all_reduce(plan, reduction, reduced), None)


def _reduce_input(
    plan: GatherPlan,
    reduction: ReductionDescription,
    grads: tuple[torch.Tensor | None, ...],
    pending: torch.Tensor | None,
) -> torch.Tensor:
    """(W, n): the trainable params' unsharded grads rank-major in the reduce dtype
    (comm_math.copy_in_grads), zeros for unused ones (every rank issues the same
    collective), plus what earlier micro-batches without sync left."""
    params = plan.comm.all_gather.params
    device = next(g for g in grads if g is not None).device
    arranged = []
    for grad, param, trainable in zip(grads, params, plan.trainable, strict=True):
        if not trainable:
            continue
        if grad is None:
            grad = torch.zeros(param.geometry.shape, dtype=reduction.reduce_dtype, device=device)
        arranged.append(arrange_for_reduce_scatter(grad, param.geometry))
    reduce_input = copy_in_grads(arranged, reduction.reduce_dtype, plan.comm.world_size)
    if pending is not None:
        reduce_input = pending + reduce_input  # eager's order: the running sum first
    return reduce_input


def _reduce_scatter(
    plan: GatherPlan,
    reduction: ReductionDescription,
    reduce_input: torch.Tensor,
    residuals: list[torch.Tensor],
) -> torch.Tensor:
    """This rank's reduced chunk of every trainable param, (sum of padded numels,)."""
    comm = plan.comm
    world_size = comm.world_size
    if reduction.any_quantized:
        policy = reduction.policy
        assert policy is not None and policy.reduce_scatter is not None
        columns = list(reduce_input.split([p.geometry.padded_shard_numel for p in reduction.params], dim=1))
        feedback = iter(residuals)
        send, layout = quantized_send_rows(
            columns,
            reduction.quantized,
            reduction.reduce_dtype,
            reduction.pre_divisor,
            world_size,
            policy.reduce_scatter,
            policy.block_size,
            [next(feedback) if q else None for q in reduction.quantized]
            if reduction.error_feedback
            else None,
        )
        return sum_quantized_rows(collectives.all_to_all(send, comm.reduce_group_name), layout)
    divide_(reduce_input, reduction.pre_divisor)
    if world_size == 1:
        return reduce_input.view(-1)
    ops = reduction.ops
    if ops.use_all_to_all:
        return sum_all_to_all(collectives.all_to_all(reduce_input, comm.reduce_group_name))
    op = "avg" if ops.average_in_reduce_scatter else "sum"
    return collectives.reduce_scatter(
        reduce_input.view(-1), plan.reduce_scatter_op, op, world_size, comm.reduce_group_name
    )


def _all_reduce(plan: GatherPlan, reduction: ReductionDescription, reduced: torch.Tensor) -> torch.Tensor:
    """HSDP: the sum (or average) over the replicas, exact and quantized legs."""
    comm = plan.comm
    group = comm.replicate_group_name
    assert group is not None
    parts = reduced.split([p.geometry.padded_shard_numel for p in reduction.params])
    exact, exact_numels, quantized = split_replica_parts(parts, reduction.replicate_quantized)
    if exact is not None:
        exact = collectives.all_reduce(exact, "avg" if reduction.ops.average_in_all_reduce else "sum", group)
    sums: list[torch.Tensor] = []
    if quantized:
        policy = reduction.policy
        assert policy is not None and policy.reduce_scatter is not None
        send, layout = quantized_sum_rows(quantized, comm.replicate_size, policy.reduce_scatter, policy.block_size)
        mine = encoded_partial_sum(collectives.all_to_all(send, group), layout)
        gathered = collectives.all_gather(mine, None, comm.replicate_size, group)
        sums = decoded_sums(gathered, layout)
    return merge_replica_sums(exact, exact_numels, sums, reduction.replicate_quantized)


def sharded_grads_of(
    plan: GatherPlan, reduced: torch.Tensor, grads: tuple[torch.Tensor | None, ...]
) -> list[torch.Tensor | None]:
    """Divide, run the hook, cut into sharded grads in the params' dtype (on the
    host under CPU offload); None for frozen params, and for unused ones (``grads``
    None) unless the group reduces unused parameters' zeros, as eager."""
    reduction = plan.comm.reduction
    assert reduction is not None
    hook = None
    if plan.hook_op is not None:
        hook_op = plan.hook_op

        def hook(tensor: torch.Tensor) -> None:
            collectives.call_hook(tensor, hook_op)

    finish_reduced(reduced, reduction.post_divisor, reduction.divided_in_collective, hook)
    locals_ = iter(sharded_grads(reduced, [p.geometry for p in reduction.params]))
    sharded: list[torch.Tensor | None] = []
    for grad, param, trainable in zip(grads, plan.comm.all_gather.params, plan.trainable, strict=True):
        local = next(locals_) if trainable else None
        if local is None or (grad is None and not reduction.reduce_unused):
            sharded.append(None)
            continue
        sharded.append(local.to(device=plan.sharded_device, dtype=param.dtype))
    return sharded
