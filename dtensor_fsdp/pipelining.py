"""torch's pipeline schedules (``torch.distributed.pipelining``) driving our modules.

torch's stages and schedules recognise FSDP by ``isinstance(m, torch.distributed.fsdp.
FSDPModule)``, a plain class that ours cannot pass without subclassing it (and the
package never imports ``torch.distributed.fsdp``). A stage module that fails the check
runs as a plain module: every microbatch's backward reduce-scatters its gradients and
re-all-gathers the parameters. torch then drives its FSDP in two places:

- the stage (``PipelineStage``): before each microbatch's backward it sets
  ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
  ``set_requires_gradient_sync(False)``; once per step (``perform_reduce_grad``) it
  sets them back and reduces the accumulated gradients; after metadata inference it
  reshards and drops the gradients it made. ``PipelineStage`` below overrides those
  three methods, with our public API (``FSDPModule.run_post_backward`` for the
  reduction), and leaves everything else to torch's stage.
- the runtime schedules with several stages per rank (``ScheduleInterleaved1F1B``,
  the zero-bubble ones, ``ScheduleLoopedBFS``, ``ScheduleDualPipeV``): their UNSHARD
  and RESHARD actions all-gather a stage's FSDP modules ahead of its compute and free
  them after. ``register_fsdp_actions(schedule)`` registers both actions through the
  schedule's public ``register_custom_function``.

This module imports ``torch.distributed.pipelining``, which imports torch's FSDP:
``import dtensor_fsdp`` does not import it; import ``dtensor_fsdp.pipelining`` where a
pipeline is built.
"""

from typing import Any

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining.schedules import (
    RESHARD,
    UNSHARD,
    _Action,
    _PipelineContext,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from .fsdp_module import FSDPModule
from .graph.pending import discard_pending
from .graph.switch import group_graphs, is_graph_mode

__all__ = ["PipelineStage", "register_fsdp_actions"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments), which drives a stage module sharded
    by ``dtensor_fsdp.fully_shard`` as torch's stage drives one sharded by torch's: each
    microbatch's backward accumulates unsharded gradients and keeps the parameters
    unsharded, and the step's end reduces them once per group. A stage module that is
    not an ``FSDPModule`` of ours runs exactly as in torch's stage."""

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.submod, FSDPModule) and is_graph_mode(self.submod):
            # Graph mode reads the flag at the forward (its graph holds the reduction),
            # not at the backward: every microbatch accumulates, and perform_reduce_grad
            # reduces the sum once, as eager's stage does.
            self.submod.set_requires_gradient_sync(False)
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if isinstance(self.submod, FSDPModule):
            # torch's settings for every microbatch, the last included: the reduction
            # waits for perform_reduce_grad, after the step's last backward.
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if isinstance(self.submod, FSDPModule):
            self.submod.set_is_last_backward(True)
            self.submod.set_reshard_after_backward(True)
            self.submod.set_requires_gradient_sync(True)
            self.submod.run_post_backward()
        # torch's: divides the (now sharded) grads by grad_scale_factor; its FSDP branch
        # does not apply to our modules.
        super().perform_reduce_grad(grad_scale_factor)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        # As torch's does for its FSDP modules: metadata inference ran a real forward
        # and backward, which left parameters unsharded and gradients behind.
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                for param in module.parameters():
                    param.grad = None
        if is_graph_mode(self.submod):
            discard_pending(group_graphs(self.submod))


def register_fsdp_actions(schedule: _PipelineSchedule) -> _PipelineSchedule:
    """Make ``schedule``'s UNSHARD and RESHARD actions all-gather and free the
    ``dtensor_fsdp`` modules of a stage, as torch's runtime schedules do for torch's
    FSDP modules: UNSHARD issues an asynchronous ``unshard()`` of every ``FSDPModule``
    in the stage module (the stage's forward or backward hooks wait for it), RESHARD
    calls their ``reshard()``. A schedule of one stage per rank (``ScheduleGPipe``,
    ``Schedule1F1B``) has no such actions and is returned unchanged, so the call may
    follow any schedule's construction.

    Args:
        schedule: a schedule of torch's ``torch.distributed.pipelining``, built over
            ``dtensor_fsdp.pipelining.PipelineStage`` stages.

    Returns:
        ``schedule``.

    Raises:
        TypeError: a stage holding ``dtensor_fsdp`` modules is torch's
            ``PipelineStage``, which would not reduce their gradients once per step.
    """
    if not isinstance(schedule, _PipelineScheduleRuntime):
        return schedule
    # The schedule's stages: torch keeps them in ``_stages`` (no public accessor); the
    # actions name a stage by its index.
    stages = {stage.stage_index: stage for stage in schedule._stages}
    for index, stage in stages.items():
        if not isinstance(stage, PipelineStage) and any(
            isinstance(m, FSDPModule) for m in stage.submod.modules()
        ):
            raise TypeError(
                f"stage {index} ({type(stage.submod).__name__}) holds dtensor_fsdp "
                f"modules but is a {type(stage).__module__}.{type(stage).__qualname__}: "
                "build it with dtensor_fsdp.pipelining.PipelineStage (same arguments)"
            )

    # A stage in graph mode gathers inside its compiled graphs, where the compiler
    # schedules the gathers: the actions leave it alone.
    def unshard(action: _Action, ctx: _PipelineContext) -> None:
        del ctx
        for module in stages[action.stage_index].submod.modules():
            if isinstance(module, FSDPModule) and not is_graph_mode(module):
                module.unshard(async_op=True)

    def reshard(action: _Action, ctx: _PipelineContext) -> None:
        del ctx
        for module in stages[action.stage_index].submod.modules():
            if isinstance(module, FSDPModule) and not is_graph_mode(module):
                module.reshard()

    schedule.register_custom_function(UNSHARD, unshard)
    schedule.register_custom_function(RESHARD, reshard)
    return schedule
