"""A group's all-gather and gradient reduction as traceable ops.

Graph mode replaces the eager hooks' all-gather and reduce-scatter with one autograd
function per gather, `GroupGather`: its forward casts the local shards to the
all-gather dtype, pads them, concatenates them and all-gathers them with one
functional collective (``torch.ops._c10d_functional``), then splits the result into
the unsharded parameters; its backward does the eager reduction's arithmetic in the
same order (cast to the reduce dtype, pre-divide, reduce-scatter or gloo's all-to-all
and sum, HSDP's all-reduce, post-divide, cast to the parameter's dtype), so that
without fusion the gradients are bitwise the eager ones. Everything it needs is in a
frozen `GatherSpec`, a constant for dynamo: nothing here reads module state.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ..runtime.profiler_labels import label

_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's shard: what its local tensor is and what it all-gathers to."""

    local_shape: tuple[int, ...]  # the DTensor's local tensor (unpadded)
    padded_local_shape: tuple[int, ...]  # every rank's chunk, padded on dim 0
    shape: tuple[int, ...]  # unsharded (for TP: the TP-local shape)
    dim: int  # the sharded dim
    dtype: torch.dtype  # the sharded param's: its gradient lands in it
    gather_dtype: torch.dtype  # mixed precision's param_dtype, else ``dtype``
    requires_grad: bool  # frozen parameters are gathered, never reduced

    @property
    def padded_local_numel(self) -> int:
        numel = 1
        for size in self.padded_local_shape:
            numel *= size
        return numel


@dataclass(frozen=True)
class ReductionSpec:
    """How the group's gradients are reduced: the eager `ReductionPlan`'s choices."""

    reduce_dtype: torch.dtype
    use_all_to_all: bool  # gloo: all-to-all, then a local sum (eager's plan)
    reduce_scatter_op: str  # "sum" or "avg"
    pre_divisor: float
    post_divisor: float
    replicate_group: str | None  # HSDP: the all-reduce over the replicate axis
    replicate_size: int
    all_reduce_op: str
    land_unused: bool  # set_reduce_scatter_unused_params: unused params get the reduced zeros


@dataclass(frozen=True)
class GatherSpec:
    """One gather: a list of shards over one process group, and their reduction."""

    shards: tuple[ShardSpec, ...]
    group: str  # the shard axis' process group name
    world_size: int
    reduction: ReductionSpec
    fqn: str = ""  # the FSDP group's, for its profiler labels

    @property
    def all_gather_nbytes(self) -> int:
        """The unsharded (padded) bytes the forward's all-gather returns."""
        return self.world_size * sum(
            s.padded_local_numel * s.gather_dtype.itemsize for s in self.shards
        )


def gather(
    spec: GatherSpec,
    locals_: list[torch.Tensor],
    sync: bool = True,
    accumulator: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The unsharded parameters (``spec.shards[i].shape``, in ``gather_dtype``) of the
    local shards ``locals_``; the gradients of the trainable ones come back reduced and
    sharded (frozen ones get none, as in eager: not computed, not reduced).

    Gradient accumulation without sync (``sync=False``): nothing is reduced; the
    unsharded gradients, in the reduce dtype and rank-major as the reduction takes them
    ((W * sum of the trainable padded local numels,)), become the gradient of
    ``accumulator`` (a leaf: autograd sums them over the micro-batches, as eager sums
    its unsharded grads). The syncing micro-batch passes that sum as ``pending``: it is
    added before the reduction, in eager's order."""
    # Kept in the graph only if dynamo is told to (capture_profiler_record_function):
    # see [Note: profiler labels] (runtime/profiler_labels.py).
    with record_function(label("all_gather", spec.fqn)):
        if not torch.is_grad_enabled() or not any(s.requires_grad for s in spec.shards):
            return all_gather(spec, locals_)  # nothing to differentiate: no autograd node
        return GroupGather.apply(spec, sync, accumulator, pending, *locals_)


def all_gather(spec: GatherSpec, locals_: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward: cast, pad, one all-gather of the concatenated shards, split."""
    rows = [_padded_rows(local, shard) for local, shard in zip(locals_, spec.shards)]
    if spec.world_size == 1:
        return tuple(_unsharded(row.unsqueeze(0), s) for row, s in zip(rows, spec.shards))
    flat = torch.cat([row.reshape(-1) for row in rows])
    gathered = _ops.wait_tensor(_ops.all_gather_into_tensor(flat, spec.world_size, spec.group))
    by_rank = gathered.view(spec.world_size, -1)  # (W, sum of padded local numels)
    outputs = []
    offset = 0
    for shard in spec.shards:
        chunk = by_rank[:, offset : offset + shard.padded_local_numel]
        outputs.append(_unsharded(chunk, shard))
        offset += shard.padded_local_numel
    return tuple(outputs)


class GroupGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        spec: GatherSpec,
        sync: bool,
        accumulator: torch.Tensor | None,
        pending: torch.Tensor | None,
        *locals_: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.spec = spec
        ctx.sync = sync
        ctx.save_for_backward(pending)
        # A parameter the forward leaves unused gets no gradient (None), as in eager.
        ctx.set_materialize_grads(False)
        outputs = all_gather(spec, locals_)
        ctx.mark_non_differentiable(
            *(out for out, shard in zip(outputs, spec.shards) if not shard.requires_grad)
        )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        spec: GatherSpec = ctx.spec
        reduction = spec.reduction
        trainable = [(g, s) for g, s in zip(grads, spec.shards) if s.requires_grad]
        # autograd calls this only if some output has a gradient.
        device = next(g for g in grads if g is not None).device
        chunks = [
            _rank_major(grad, shard, spec.world_size, reduction.reduce_dtype, device)
            for grad, shard in trainable
        ]
        reduce_input = torch.cat(chunks, dim=1)  # (W, sum of trainable padded local numels)
        (pending,) = ctx.saved_tensors
        if pending is not None:
            reduce_input = pending.view_as(reduce_input) + reduce_input
        unused = (None,) * len(grads)
        if not ctx.sync:
            return (None, None, reduce_input.reshape(-1), None, *unused)
        with record_function(label("post_backward_reduce", spec.fqn)):
            return (None, None, None, None, *_reduced_shards(reduce_input, spec, grads))


def _reduced_shards(
    reduce_input: torch.Tensor, spec: GatherSpec, grads: tuple[torch.Tensor | None, ...]
) -> list[torch.Tensor | None]:
    """Reduce (W, n) and cut this rank's chunk into each trainable parameter's sharded
    gradient; None for frozen ones, and for unused ones unless the group reduces
    unused parameters' zeros (``set_reduce_scatter_unused_params``), as eager."""
    reduction = spec.reduction
    if reduction.pre_divisor != 1.0:
        reduce_input = reduce_input / reduction.pre_divisor
    reduced = _reduce_scatter(reduce_input, spec)
    if reduction.replicate_group is not None:
        reduced = _ops.wait_tensor(
            _ops.all_reduce(reduced, reduction.all_reduce_op, reduction.replicate_group)
        )
    if reduction.post_divisor != 1.0:
        reduced = reduced / reduction.post_divisor
    sharded: list[torch.Tensor | None] = []
    offset = 0
    for grad, shard in zip(grads, spec.shards):
        if not shard.requires_grad:
            sharded.append(None)
            continue
        piece = reduced[offset : offset + shard.padded_local_numel]
        offset += shard.padded_local_numel
        if grad is None and not reduction.land_unused:
            sharded.append(None)
            continue
        local = piece.view(shard.padded_local_shape)[: shard.local_shape[0]]
        sharded.append(local.to(shard.dtype))
    return sharded


def _padded_rows(local: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """``local`` in the all-gather dtype, padded on dim 0 to ``padded_local_shape``."""
    local = local.to(shard.gather_dtype)
    missing = shard.padded_local_shape[0] - local.shape[0]
    if missing == 0:
        return local
    # F.pad pads the last dims first: (0, 0) for each trailing dim, then dim 0.
    return F.pad(local, (0, 0) * (local.dim() - 1) + (0, missing))


def _unsharded(chunk: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Every rank's padded chunk (W, padded_local_numel) as the unsharded tensor."""
    world_size = chunk.shape[0]
    by_rank = chunk.reshape(world_size, *shard.padded_local_shape)
    if shard.dim == 0:
        rows = by_rank.reshape(world_size * shard.padded_local_shape[0], *shard.shape[1:])
        return rows[: shard.shape[0]]
    # Shard(dim != 0) divides evenly: the chunks sit side by side along ``dim``.
    return torch.cat(by_rank.unbind(0), dim=shard.dim)


def _rank_major(
    grad: torch.Tensor | None,
    shard: ShardSpec,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``grad`` (unsharded) in ``dtype`` as (W, padded_local_numel): rank r's chunk in
    row r, the padding zero. A parameter the forward left unused (None) reduces zeros,
    so every rank issues the same collective."""
    if grad is None:
        return torch.zeros(world_size, shard.padded_local_numel, dtype=dtype, device=device)
    grad = grad.to(dtype)
    if shard.dim != 0:
        return torch.stack(grad.chunk(world_size, dim=shard.dim)).reshape(world_size, -1)
    missing = world_size * shard.padded_local_shape[0] - grad.shape[0]
    if missing:
        grad = F.pad(grad, (0, 0) * (grad.dim() - 1) + (0, missing))
    return grad.reshape(world_size, -1)


def _reduce_scatter(reduce_input: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
    """This rank's reduced chunk, (sum of padded local numels,)."""
    world_size = spec.world_size
    if world_size == 1:
        return reduce_input.view(-1)
    flat = reduce_input.reshape(-1)
    if spec.reduction.use_all_to_all:
        splits = [flat.numel() // world_size] * world_size
        received = _ops.wait_tensor(_ops.all_to_all_single(flat, splits, splits, spec.group))
        return received.view(world_size, -1).sum(dim=0)
    return _ops.wait_tensor(
        _ops.reduce_scatter_tensor(flat, spec.reduction.reduce_scatter_op, world_size, spec.group)
    )
