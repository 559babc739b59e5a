"""Small reductions across ranks for the benchmarks' own bookkeeping (slowest-rank step
times, all-ranks flags), on whichever device the process group's backend takes.

A CPU tensor handed to NCCL fails ("No backend type associated with device type cpu"),
and a CUDA tensor handed to gloo-only groups costs a copy; so the device is asked of the
group, never derived from the backend's name (``dist.get_backend()`` reads ``"nccl"``,
``"gloo"``, ``"cuda:nccl,cpu:gloo"``, ``"undefined"``...).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: the CPU when one of the
    group's backends serves it (gloo; NCCL with a gloo side), as torch's object
    collectives choose, else the device type of its only backends (NCCL alone: CUDA;
    a tensor made on ``torch.device("cuda")`` lands on the current device, which the
    benchmarks set to the rank's GPU before joining the group).

    Raises:
        RuntimeError: no backend is registered with the group yet.
    """
    group = group or dist.group.WORLD
    device_types = [device.type for device in group._device_types]
    if "cpu" in device_types:
        return torch.device("cpu")  # no host-device copy, no stream to order against
    if not device_types:
        raise RuntimeError(
            "the process group has no backend registered yet: join it with "
            "init_process_group(backend=...) before reducing across ranks"
        )
    return torch.device(device_types[0])


def reduce_over_ranks(
    values: Sequence[float], op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None = None
) -> list[float]:
    """``values`` reduced elementwise over the ranks of ``group`` with ``op`` (e.g.
    ``ReduceOp.MAX``: each step's slowest rank), in float64; every rank gets the result.

    The all-reduce is synchronous (``wait()`` orders the current stream after it), so
    reading the result back is ordered after the collective on CUDA too.
    """
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()
