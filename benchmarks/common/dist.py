"""Joining and leaving torchrun's process group, and small reductions across ranks for
the benchmarks' own bookkeeping (slowest-rank step times, all-ranks flags), on whichever
device the process group's backend takes.

A CPU tensor handed to NCCL fails ("No backend type associated with device type cpu"),
and a CUDA tensor handed to gloo-only groups costs a copy; so the device is asked of the
group, never derived from the backend's name (``dist.get_backend()`` reads ``"nccl"``,
``"gloo"``, ``"cuda:nccl,cpu:gloo"``, ``"undefined"``...).
"""

import gc
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from common.device import sync


def init_distributed(device_arg: str) -> torch.device:
    """Join torchrun's process group: NCCL on CUDA (``device_arg`` "cuda", or "auto"
    with CUDA present), gloo on CPU; returns this rank's device."""
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def leave_process_group() -> None:
    """Destroy the default group, after the cyclic GC has run.

    FSDP's module <-> state cycles keep the mesh (and its group) alive until the cyclic
    GC runs; at interpreter exit gloo's teardown can abort. Collect first.
    """
    gc.collect()
    dist.destroy_process_group()


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


def slowest_seconds(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds of ``fn()`` on the slowest rank, after a barrier. On CUDA (``device``)
    the device is drained before the clock starts (no earlier kernel is counted) and
    after ``fn`` (none of its kernels is missed)."""
    dist.barrier()
    if device is not None:
        sync(device)
    start = time.perf_counter()
    fn()
    if device is not None:
        sync(device)
    elapsed = time.perf_counter() - start
    return reduce_over_ranks([elapsed], dist.ReduceOp.MAX)[0]
