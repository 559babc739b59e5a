"""Landing a group's reduced gradients on the sharded params' ``.grad``.

The last step of a reduction: divide once, run the user's all-reduce hook (in torch's
order), and add each parameter's chunk to its sharded ``.grad`` (CPU offload: copied to
the host, asynchronously where nothing reads it there before the end of backward).
"""

from collections.abc import Callable

import torch

from ...api import CPUOffloadPolicy
from ..param import FSDPParam
from ..streams import CommStreams

# Reduce dtypes whose range lets the collective sum before dividing.
NO_OVERFLOW_RISK = (torch.float32, torch.bfloat16)


def split_reduced(reduced: torch.Tensor, params: list[FSDPParam]) -> tuple[torch.Tensor, ...]:
    """Each param's padded chunk of ``reduced``, (sum of padded chunk numels,)."""
    return reduced.split([p.padded_shard_numel for p in params])


def land_sharded_grads(
    params: list[FSDPParam],
    reduced: torch.Tensor,
    post_divisor: float,
    force_sum_reduction: bool,
    hook: tuple[Callable[[torch.Tensor], None] | None, object | None],
    streams: CommStreams,
    offload: CPUOffloadPolicy | None,
) -> object | None:
    """Divide once and run the user's hook (in torch's order), and land each param's
    chunk on its ``.grad``.

    Args:
        reduced: (sum of padded chunk numels,), the params' chunks in their order.
        hook: the user's all-reduce hook and the stream it runs on (None: the current).
        offload: CPU offload's policy, if on: the sharded grads land in host memory
            (asynchronously only with ``pin_memory``, see `accumulate_sharded_grad`).

    Returns:
        The event after asynchronous device-to-host copies (the host waits for it at
        the end of backward), or None if none is running.
    """
    # The hook sees what torch's sees: torch divides inside the collective (AVG,
    # PREMUL_SUM) for fp32/bf16 unless sums are forced, and after the hook otherwise.
    divided_in_collective = not force_sum_reduction and reduced.dtype in NO_OVERFLOW_RISK
    if post_divisor != 1.0 and divided_in_collective:
        reduced.div_(post_divisor)
    all_reduce_hook, hook_stream = hook
    if all_reduce_hook is not None:
        with streams.on_user_stream(hook_stream):
            all_reduce_hook(reduced)
    if post_divisor != 1.0 and not divided_in_collective:
        reduced.div_(post_divisor)
    to_host = streams.copy_to_host if offload is not None else None
    pin_memory = offload is not None and offload.pin_memory
    copying = [
        fsdp_param.accumulate_sharded_grad(chunk, to_host, pin_memory)
        for fsdp_param, chunk in zip(params, split_reduced(reduced, params), strict=True)
    ]
    return streams.record_compute() if any(copying) else None
