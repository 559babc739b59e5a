"""benchmarks/common/dist.py: the benchmarks' own reductions across ranks (slowest-rank
step times, all-ranks flags) hand each collective a tensor its process group's backend
serves.

Not a comparison with torch's fully_shard: bookkeeping of the benchmark scripts. As
filed, ``bench_train.py --device cuda`` all-reduced a CPU tensor on NCCL and died with
"No backend type associated with device type cpu". torch's ``fake`` backend registered
for one device type (``"cuda:fake"``, ``"meta:fake"``) stands in for NCCL on this
CPU-only build: the same group shape, with no CPU backend, raising the same error for a
CPU tensor.
"""

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The benchmarks import their shared modules as ``common.*`` (benchmarks/ on sys.path).
sys.path.insert(0, str(BENCHMARKS))

from common.dist import collective_device, reduce_over_ranks, slowest_seconds


@contextmanager
def _default_group(backend: str) -> Iterator[None]:
    """This process as rank 0 of ``backend``'s default group: of 2 on the fake backend,
    which communicates nothing; of 1 on gloo, a real backend that would wait for rank 1."""
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process")
    if backend == "gloo":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Stopped(Exception):
    def __init__(self, devices: list[str]) -> None:
        super().__init__(devices)
        self.devices = devices


class _StopAtReduction(TorchDispatchMode):
    """Raises at the first collective other than a barrier, with the device types of the
    tensors handed to it, before any backend sees them (a meta tensor's result could not
    be read back).

    A barrier is passed on with a meta tensor: on this CPU-only build ``dist.barrier``
    takes a CPU tensor (there is no accelerator), where on a GPU it takes one on the
    rank's GPU, which NCCL serves.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname == "barrier":
            args = (torch.empty(1, device="meta"), *args[1:])
        elif func.namespace == "c10d":
            tensors = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            raise _Stopped([t.device.type for t in tensors if isinstance(t, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("backend", "device_type"),
    [
        ("cuda:fake", "cuda"),  # NCCL's shape: one backend, for CUDA only (the filed crash)
        ("meta:fake", "meta"),
        ("cuda:fake,cpu:fake", "cpu"),  # NCCL with a gloo side, as with CPU offload
        ("fake", "cpu"),  # one backend serving every device type
        ("gloo", "cpu"),  # serves CPU and CUDA tensors: the CPU needs no copy
    ],
)
def test_collective_device_is_one_the_backend_serves(backend: str, device_type: str) -> None:
    with _default_group(backend):
        assert collective_device().type == device_type


def _one_unsharded_round(bench_train: ModuleType) -> None:
    """bench_train's timing loop, one step of a 1-layer plain model computed on the CPU."""
    config = dataclasses.replace(bench_train.PRESETS["tiny"](), n_layers=1, max_seq_len=8)
    args = argparse.Namespace(seed=0, lr=1e-3, batch_size=1, seq_len=8, warmup=0, steps=1, block=1)
    impl = bench_train.build_impl("unsharded", config, None, torch.device("cpu"), args)
    bench_train.time_rounds([impl], config, args, torch.device("cpu"))


# What each benchmark reduces across ranks, given bench_train and bench_optim.
REDUCTIONS: dict[str, Callable[[ModuleType, ModuleType], object]] = {
    "reduce_over_ranks": lambda train, optim: reduce_over_ranks([0.25, 1.5], dist.ReduceOp.MAX),
    "bench_train.time_rounds": lambda train, optim: _one_unsharded_round(train),
    "slowest_seconds": lambda train, optim: slowest_seconds(lambda: None, torch.device("cpu")),
    "bench_optim.all_ranks": lambda train, optim: optim.all_ranks(True),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reductions_hand_a_non_cpu_backend_no_cpu_tensor(
    reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The filed crash: under a group whose only backend serves another device type,
    every benchmark reduction hands its collective a tensor of that type."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their neighbours
    bench_train = importlib.import_module("bench_train")
    bench_optim = importlib.import_module("bench_optim")
    with _default_group("meta:fake"), _StopAtReduction(), pytest.raises(_Stopped) as stopped:
        REDUCTIONS[reduction](bench_train, bench_optim)
    assert stopped.value.devices == ["meta"]


def test_reduction_on_gloo_returns_the_values_in_float64() -> None:
    """W=1: the reduction of one rank's values is those values; 1/3 comes back exactly,
    which a float32 round trip would not give."""
    with _default_group("gloo"):
        assert reduce_over_ranks([1 / 3, 2.5], dist.ReduceOp.MAX) == [1 / 3, 2.5]
