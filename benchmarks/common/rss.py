"""A process's peak resident set around one call, as ``bench_full_export.py`` and
``bench_weight_sync.py`` measure host memory, and the model both measure it on.
(Live tensor bytes, as MemTracker counts them: ``tensor_memory.py``.)

``rss``: the peak resident set above where the call started (``VmHWM`` after resetting
it through ``/proc/self/clear_refs``; Linux only); ``python``: Python objects alone
(``tracemalloc``); ``s``: wall time. Launch with ``MALLOC_MMAP_THRESHOLD_=1048576``:
glibc then maps every block of 1 MiB or more on its own and unmaps it when freed, so the
resident set follows the live tensors; without it glibc keeps freed blocks for reuse
and the figures drift with what ran before.
"""

import gc
import os
import time
import tracemalloc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

MIB = 1 << 20


def linear_stack(n_layers: int, dim: int, shard: Callable[..., nn.Module]) -> nn.Module:
    """``n_layers`` bias-free ``Linear(dim, dim)`` (fp32), ``shard`` (ours or torch's
    ``fully_shard``) on each and on the root, over every rank: the full model is
    ``n_layers`` times its largest tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(n_layers)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        shard(layer, mesh=mesh)
    return shard(model, mesh=mesh)


def vm_hwm() -> int | None:
    """The peak resident set (bytes) since the last reset, or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except OSError:
        return None


def reset_vm_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets the peak resident set to the current one
    except OSError:
        pass


def measure(fn: Callable[[], object]) -> dict[str, float]:
    """``fn()``'s peak memory above the start (MiB: ``rss``, ``python``) and time (``s``)."""
    gc.collect()
    reset_vm_hwm()
    rss_before = vm_hwm()
    tracemalloc.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss_after = vm_hwm()
    rss = (rss_after - rss_before) / MIB if rss_before and rss_after else float("nan")
    return {"rss": rss, "python": python_peak / MIB, "s": seconds}


def mmap_threshold_set() -> bool:
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None
