"""The session's pool of gloo ranks (tests/_pool.py): reused, reset, replaced.

A run on the pool must see what a fresh spawn would: its own process group and the
process state a spawned rank starts with, whatever the previous run left; a failed run,
or one that leaves a thread alive, gets the next run a fresh pair of workers (tests
with their own pool, so that the session's is not disturbed: full tier, as each
failure costs a spawn).
"""

import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import DistributedError, run_distributed, set_running_test
from tests._pool import GlooPools, PoolRetired, WorkerPool


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    pool = WorkerPool()
    yield pool
    pool.close()


def _state(rank: int, world_size: int) -> dict[str, Any]:
    """What a run sees of the process and its group."""
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("shown to every run", UserWarning)  # default filter: once per place
    return {
        "pid": os.getpid(),
        "sum": summed.item(),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "path": list(sys.path),
        "threads": torch.get_num_threads(),
        "rand": torch.rand(3).tolist(),
        "env": os.environ.get("DTENSOR_FSDP_POOL_TEST"),
        "cwd": os.getcwd(),
        "warned": len(caught),
    }


def _dirty(rank: int, world_size: int, tmp: str) -> int:
    """Leave everything a run could leave behind, short of a thread."""
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    sys.path.insert(0, tmp)
    torch.set_num_threads(2)
    torch.manual_seed(1234 + rank)
    os.environ["DTENSOR_FSDP_POOL_TEST"] = "dirty"
    os.chdir(tmp)
    warnings.simplefilter("ignore")
    dist.new_group(list(range(world_size)))  # never destroyed by the run
    return os.getpid()


def _raises_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke")
    dist.barrier()  # rank 0 blocks here: the pool must not wait for it


def _leaves_a_thread(rank: int, world_size: int) -> int:
    threading.Thread(target=time.sleep, args=(60,), daemon=True, name="left behind").start()
    return os.getpid()


_BARS: list = []  # open progress bars, as a framework may keep one


def _leaves_a_progress_bar(rank: int, world_size: int) -> tuple[int, bool]:
    import io

    from tqdm.auto import tqdm  # a subclass, as Hugging Face's bars

    _BARS.append(tqdm(total=1, file=io.StringIO()))
    return os.getpid(), tqdm.monitor is not None and tqdm.monitor.is_alive()


def _registers_a_device(rank: int, world_size: int) -> int:
    from tests import _standin_device

    _standin_device.register()
    return os.getpid()


def _device_name(rank: int, world_size: int) -> str:
    return torch._C._get_privateuse1_backend_name()


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(60)


def _gathered_on_a_mesh(rank: int, world_size: int, groups_before: int) -> list[float]:
    """A DTensor op on a mesh of a new group made after ``groups_before`` others (its
    name depends on what the run made before it), then a gather over that group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    for _ in range(groups_before):
        dist.new_group(list(range(world_size)))
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu")
    x = distribute_tensor(torch.arange(2.0 * world_size), mesh, [Shard(0)])
    return (x + 1).full_tensor().tolist()  # the sum's spec comes from sharding propagation


def _pids(records: list[Any]) -> set[int]:
    return {r["pid"] if isinstance(r, dict) else r for r in records}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
def test_a_run_finds_the_state_the_last_run_found_whatever_it_left(
    gloo_pool: GlooPools, world_size: int, tmp_path
) -> None:
    before = gloo_pool.run(_state, world_size)
    assert _pids(gloo_pool.run(_dirty, world_size, str(tmp_path))) == _pids(before)
    after = gloo_pool.run(_state, world_size)
    assert _pids(after) == _pids(before), "the workers were reused"
    assert after == before
    assert [r["groups"] for r in after] == [1] * world_size
    assert [r["sum"] for r in after] == [world_size * (world_size + 1) / 2] * world_size


def test_a_run_finds_no_mesh_of_a_previous_run(gloo_pool: GlooPools) -> None:
    """DeviceMesh equality ignores its groups' names, which restart with every process
    group: DTensor's caches would hand this run's op the previous run's mesh, whose
    groups are gone ("Could not resolve the process group registered under the name")."""
    expected = [[1.0, 2.0, 3.0, 4.0]] * 2
    assert gloo_pool.run(_gathered_on_a_mesh, 2, 3) == expected
    assert gloo_pool.run(_gathered_on_a_mesh, 2, 0) == expected


@pytest.mark.full
def test_a_run_finds_the_state_of_a_fresh_spawn(pool: WorkerPool) -> None:
    pooled, spawned = pool.run(_state), run_distributed(_state, 2)
    pool.run(_state)
    assert pool.spawns == 1
    for ours, fresh in zip(pooled, spawned, strict=True):
        # A fresh spawn's RNG state is not the same in every spawn.
        assert {k: v for k, v in ours.items() if k not in ("pid", "rand")} == {
            k: v for k, v in fresh.items() if k not in ("pid", "rand")
        }


@pytest.mark.full
def test_a_failed_run_raises_and_the_next_run_gets_fresh_workers(pool: WorkerPool) -> None:
    before = _pids(pool.run(_state))
    spawns = pool.spawns
    with pytest.raises(DistributedError, match="rank 1 broke"):
        pool.run(_raises_on_rank_1)
    after = _pids(pool.run(_state))
    assert pool.spawns == spawns + 1 and not after & before


@pytest.mark.full
def test_a_run_that_leaves_a_thread_retires_its_workers(pool: WorkerPool) -> None:
    with pytest.warns(PoolRetired, match=r"_leaves_a_thread: threads still alive .*'left behind'"):
        before = _pids(pool.run(_leaves_a_thread))
    after = _pids(pool.run(_state))
    assert not after & before


@pytest.mark.full
def test_a_progress_bar_left_open_keeps_the_workers(pool: WorkerPool) -> None:
    """tqdm's monitor thread (a Hugging Face or Lightning progress bar not closed) is
    stopped after the run, not a reason to retire; the next bar starts its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PoolRetired)
        before = pool.run(_leaves_a_progress_bar)
        after = pool.run(_leaves_a_progress_bar)
    assert _pids(after) == _pids(before)
    assert all(monitor for _, monitor in before + after), "the bars started their monitors"


@pytest.mark.full
def test_a_run_that_registers_a_device_retires_its_workers(pool: WorkerPool) -> None:
    """A renamed PrivateUse1 backend cannot be undone: a later run's DCP would see it."""
    with pytest.warns(PoolRetired, match="a device registered by the run: "):
        before = _pids(pool.run(_registers_a_device))
    assert not _pids(pool.run(_state)) & before
    assert pool.run(_device_name) == ["privateuseone"] * 2


@pytest.mark.full
def test_a_run_past_its_timeout_fails_and_the_next_run_gets_fresh_workers(
    pool: WorkerPool,
) -> None:
    before = _pids(pool.run(_state))
    with pytest.raises(DistributedError, match="timed out after 3s"):
        pool.run(_sleeps, timeout=3)
    assert not _pids(pool.run(_state)) & before


@pytest.fixture
def in_the_fast_tier(request: pytest.FixtureRequest) -> Iterator[None]:
    set_running_test(request.node.nodeid, is_full=False)
    yield
    set_running_test(request.node.nodeid, is_full=True)


def test_the_fast_tier_refuses_four_ranks_and_torchrun(in_the_fast_tier, tmp_path) -> None:
    from tests._torchrun import torchrun

    with pytest.raises(pytest.fail.Exception, match="spawns 4 ranks.*marked `full`"):
        run_distributed(_state, 4)
    with pytest.raises(pytest.fail.Exception, match="launches torchrun"):
        torchrun(tmp_path / "job.py", log=tmp_path / "log")


def _compiles_with_inductor(rank: int, world_size: int) -> None:
    torch.compile(torch.sin, backend="inductor")(torch.ones(2))


@pytest.mark.full
def test_the_fast_tier_refuses_an_inductor_compile_in_the_ranks(
    in_the_fast_tier, pool: WorkerPool
) -> None:
    with pytest.raises(pytest.fail.Exception, match="compiles with inductor in its ranks"):
        pool.run(_compiles_with_inductor)
