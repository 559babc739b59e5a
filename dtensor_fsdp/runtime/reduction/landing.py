"""Landing a group's reduced gradients on the sharded params' ``.grad``.

The last step of a reduction: divide once, run the user's all-reduce hook (in torch's
order), and add each parameter's chunk to its sharded ``.grad`` (CPU offload: copied to
the host, asynchronously where nothing reads it there before the end of backward).
"""

from collections.abc import Callable

import torch

from ...api import CPUOffloadPolicy
from ..comm_description import ReductionDescription
from ..comm_math import finish_reduced, sharded_grads
from ..param import FSDPParam
from ..streams import CommStreams


def split_reduced(reduced: torch.Tensor, params: list[FSDPParam]) -> tuple[torch.Tensor, ...]:
    """Each param's padded chunk of ``reduced``, (sum of padded chunk numels,)."""
    return reduced.split([p.padded_shard_numel for p in params])


def land_sharded_grads(
    params: list[FSDPParam],
    reduced: torch.Tensor,
    description: ReductionDescription,
    hook_stream: object | None,
    streams: CommStreams,
    offload: CPUOffloadPolicy | None,
) -> object | None:
    """Divide once and run the user's hook (in torch's order: `comm_math.finish_reduced`),
    and land each param's chunk on its ``.grad``.

    Args:
        reduced: (sum of padded chunk numels,), the params' chunks in their order.
        description: the reduction's (its divisor and hook).
        hook_stream: the stream the user's hook runs on (None: the current).
        offload: CPU offload's policy, if on: the sharded grads land in host memory
            (asynchronously only with ``pin_memory``, see `accumulate_sharded_grad`).

    Returns:
        The event after asynchronous device-to-host copies (the host waits for it at
        the end of backward), or None if none is running.
    """
    user_hook = description.hook
    hook: Callable[[torch.Tensor], None] | None = None
    if user_hook is not None:

        def hook(tensor: torch.Tensor) -> None:
            with streams.on_user_stream(hook_stream):
                user_hook(tensor)

    finish_reduced(reduced, description.post_divisor, description.divided_in_collective, hook)
    to_host = streams.copy_to_host if offload is not None else None
    pin_memory = offload is not None and offload.pin_memory
    locals_ = sharded_grads(reduced, [p.geometry for p in params])
    copying = [
        fsdp_param.accumulate_sharded_grad(local, to_host, pin_memory)
        for fsdp_param, local in zip(params, locals_, strict=True)
    ]
    return streams.record_compute() if any(copying) else None
