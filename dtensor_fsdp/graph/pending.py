"""Reducing what micro-batches without sync left, outside any forward: graph mode's
``FSDPModule.run_post_backward``.

Eager's ``run_post_backward`` reduces the unsharded gradients that backwards under
``set_requires_gradient_sync(False)`` accumulated (torch's pipeline stages end each step
with it: dtensor_fsdp/pipelining.py). In graph mode those sums are the accumulator
leaves' gradients (graph/gather.py); this reduces them with the same executor, its
functional collectives run eagerly, and lands the sharded gradients as eager lands them.
"""

import torch

from .gather import reduce, sharded_grads_of
from .group_graph import GroupGraph


def reduce_pending(graphs: list[GroupGraph]) -> None:
    """Reduce and land every group's pending sum (groups without one: nothing)."""
    for graph in graphs:
        pending = graph.accumulator.grad
        if pending is None:
            continue
        graph.accumulator.grad = None
        all_reduce = graph.group.reduction.settings.requires_all_reduce
        pending_partial = graph.partial.grad if all_reduce else None
        graph.partial.grad = None
        with torch.no_grad():
            residuals = [r for r in graph.residuals if r is not None]
            reduced = reduce(graph.plan, pending, residuals, all_reduce, pending_partial)
            if reduced.partial is not None:
                graph.partial.grad = reduced.partial
                continue
            assert reduced.reduced is not None
            # Every trainable param's sum is in the accumulator: all of them land.
            present = tuple(pending for _ in graph.params)
            locals_ = sharded_grads_of(graph.plan, reduced.reduced, present)
        for bound, local in zip(graph.params, locals_, strict=True):
            if local is not None:
                bound.fsdp_param.accumulate_sharded_grad(local)


def discard_pending(graphs: list[GroupGraph]) -> None:
    """Drop every group's pending sums (a forward and backward whose gradients are not
    wanted: a pipeline stage's metadata inference)."""
    for graph in graphs:
        graph.accumulator.grad = None
        graph.partial.grad = None
