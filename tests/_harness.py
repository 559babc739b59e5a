"""Our own short multi-process harness for the tests.

Parent side:

- ``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, joins them
  into one gloo group through a ``FileStore`` in a fresh temp directory (no ports), runs
  ``fn(rank, world_size, *args)`` in each and returns the ranks' return values, in rank
  order. A child's exception is re-raised in the parent with the rank and the child's
  traceback; a run past ``timeout`` kills every child and fails, naming what each rank
  was doing last, so no test hangs.
- ``run_distributed(fn, world_size, *args, pool=gloo_pool)``: the same run on the
  session's reusable gloo ranks (tests/_pool.py, torch's ``MultiProcContinuousTest``
  idea: 2 or 4 of them), spawned once for every test file that passes the
  ``gloo_pool`` fixture: each run gets a fresh process group and the process state a
  fresh spawn would have.
- ``scenario_records(run, name)`` picks one scenario's records out of a run of
  ``run_scenarios`` and fails the calling test with the traceback if it raised.
- ``fake_mesh(world_size)`` builds a 1D CPU ``DeviceMesh`` of any size in this one
  process on torch's ``fake`` process group, for unit tests of placements and shapes
  (collectives return without moving data, so values are meaningless).

Child side (inside ``fn``):

- ``run_scenarios({name: thunk})`` runs several checks in one spawn (spawning costs
  seconds on two cores), records each one's result or traceback, and keeps the ranks
  in step between scenarios (see ``run_scenarios``).
- ``report_progress(text)`` tells the parent what this rank is doing, for timeouts.

Every ``torch.testing._internal`` import lives in this file only: those internals move
between torch 2.11 and 2.14, and one place is easy to fix.

Results come back through one pipe per rank, pickled with the plain ``pickle`` (torch's
multiprocessing pickler would pass tensors as shared memory owned by a child that is
about to exit), and never through exit codes: gloo workers sometimes abort at
interpreter exit after their work is done ("terminate called without an active
exception"), so a rank that has sent its result has passed, whatever its exit code
(workers should destroy their process group before exiting; the harness does).

Tiers (tests/conftest.py, docs/testing.md): a test marked ``full`` may spawn 4 ranks or
more, launch ``torchrun`` (tests/_torchrun.py) and compile with inductor; one in the
fast tier (``-m "not full"``) that does fails with the fix named (`require_full`), so
the fast tier cannot silently grow heavy.
"""

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT_S = 120.0
# After the first failure, how long the other ranks get to report their own (often the
# more telling one) before they are killed; most are blocked in a collective by then.
_GRACE_AFTER_ERROR_S = 2.0
# How long a rank waits at the end of a scenario for the others to finish it. Healthy
# ranks leave their last collective together, so this only runs out when a rank raised
# and the others are blocked in a collective it will never join.
_SCENARIO_SYNC_TIMEOUT_S = 30.0


class DistributedError(RuntimeError):
    """A child rank raised, died without reporting, or the run timed out."""


class Pools(Protocol):
    """Reusable ranks (tests/_pool.py's `GlooPools`)."""

    def serves(self, world_size: int) -> bool: ...

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float
    ) -> list[Any]: ...


# ---------------------------------------------------------------------------
# Tiers: what a test in the fast tier may not do
# ---------------------------------------------------------------------------


@dataclass
class _RunningTest:
    nodeid: str = ""
    # Outside a test (a script importing the harness, collection) nothing is refused.
    is_full: bool = True
    inductor_graphs: int = 0  # `inductor_graphs()` at the test's setup


_running = _RunningTest()


def set_running_test(nodeid: str, is_full: bool) -> None:
    """tests/conftest.py, at each test's setup: whether it is marked ``full``."""
    _running.nodeid, _running.is_full = nodeid, is_full
    _running.inductor_graphs = inductor_graphs()


def inductor_graphs() -> int:
    """How many graphs inductor compiled or loaded from its cache in this process: its
    code cache's modules (kept across ``torch._dynamo.reset()``; not counting a backend
    built or a config read, nor aot_eager's graphs; 0 before inductor is imported)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    return len(codecache.PyCodeCache.modules) if codecache is not None else 0


def check_no_inductor_compile() -> None:
    """tests/conftest.py, after each test: `require_full` if it compiled with inductor
    in this process (fixtures included)."""
    if inductor_graphs() != _running.inductor_graphs:
        require_full("compiles with inductor")


def require_full(what: str) -> None:
    """Fail the running test if it is in the fast tier: it ``what`` (spawns 4 ranks,
    launches torchrun, compiles with inductor), which only ``full`` tests may."""
    if not _running.is_full:
        pytest.fail(
            f"{_running.nodeid} {what}, which only tests marked `full` may: add its file to "
            "FULL_PATHS in tests/conftest.py, or mark it (module: `pytestmark = "
            "pytest.mark.full`; one fixture parameter: `pytest.param(4, marks="
            "pytest.mark.full)`)",
            pytrace=False,
        )


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    threads_per_rank: int = 1,
    pool: Pools | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of processes.
        *args: picklable arguments passed to every rank after ``(rank, world_size)``.
        timeout: seconds for the whole run, spawn included.
        threads_per_rank: ``torch.set_num_threads`` in each child, so that ranks do not
            oversubscribe the cores.
        pool: the session's ``gloo_pool`` fixture (tests/_pool.py): a run of a world
            size it serves (2, 4) and one thread per rank runs on its workers instead
            of new ones.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        DistributedError: with the rank and its traceback if a child raised, or the
            exit code if it died without reporting, or the silent ranks (and their last
            progress report) on timeout.
    """
    if world_size >= 4:
        require_full(f"spawns {world_size} ranks")
    if pool is not None and pool.serves(world_size) and threads_per_rank == 1:
        return pool.run(fn, world_size, *args, timeout=timeout)
    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="dtensor_fsdp_store_")
    store_path = os.path.join(store_dir, "store")
    procs, conns = [], {}
    outcome = None
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(fn, rank, world_size, store_path, threads_per_rank, send_end, args),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            # Close our copy of the send end, so a child that dies shows up as EOF.
            send_end.close()
            procs.append(proc)
            conns[recv_end] = rank
        outcome = collect(conns, procs, timeout)
    finally:
        # Ranks that reported get a moment to exit on their own; after a failure the
        # others are usually blocked in a collective, so they are killed at once.
        stop(procs, patience_s=5.0 if outcome and not outcome.errors else 0.0)
        for conn in conns:
            conn.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return outcome.results_or_raise(world_size)


@dataclass
class Outcome:
    """What the ranks of one run reported."""

    results: dict[int, Any]
    errors: list[tuple[int, str]]  # (rank, message), in order of arrival
    # (rank, why): a pool worker that is not fit for another run (see WorkerPool).
    retired: list[tuple[int, str]] = field(default_factory=list)
    compiled_with_inductor: bool = False

    def results_or_raise(self, world_size: int) -> list[Any]:
        """Each rank's result, by rank; the first failure raised as DistributedError."""
        if self.errors:
            rank, message = self.errors[0]
            others = sorted(r for r, _ in self.errors[1:])
            extra = f" (ranks {others} also failed)" if others else ""
            raise DistributedError(f"rank {rank} of {world_size} failed{extra}:\n{message}")
        if self.compiled_with_inductor:
            require_full("compiles with inductor in its ranks")
        return [self.results[r] for r in range(world_size)]


def collect(conns: dict[Connection, int], procs: list[mp.Process], timeout: float) -> Outcome:
    """Read messages until every rank reports, one fails (plus a grace), or time runs out."""
    deadline = time.monotonic() + timeout
    outcome = Outcome({}, [])
    progress: dict[int, str] = {}
    pending = dict(conns)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if outcome.errors:
                break  # the grace after an error ran out: report the error, not a timeout
            doing = "; ".join(
                f"rank {r}: {progress.get(r, 'no progress reported')}" for r in sorted(pending.values())
            )
            raise DistributedError(
                f"timed out after {timeout:.0f}s; ranks {sorted(outcome.results)} finished, "
                f"killed the rest. Last progress: {doing}"
            )
        for conn in wait(list(pending), timeout=remaining):
            rank = pending[conn]
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=5)
                kind, payload = "error", (
                    f"rank {rank} exited (exit code {procs[rank].exitcode}) without reporting; "
                    f"last progress: {progress.get(rank, 'none')} (a child that cannot import "
                    f"the test module or unpickle fn dies before reporting: see its stderr)"
                )
            if kind == "progress":
                progress[rank] = payload
                continue
            if kind == "inductor":
                outcome.compiled_with_inductor = True
                continue
            if kind == "retire":
                outcome.retired.append((rank, payload))
                continue
            del pending[conn]
            if kind == "ok":
                outcome.results[rank] = payload
            else:
                outcome.errors.append((rank, payload))
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
    return outcome


def stop(procs: list[mp.Process], patience_s: float) -> None:
    """Give the children ``patience_s`` to exit on their own, then kill the rest."""
    deadline = time.monotonic() + patience_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def scenario_records(run: list[dict[str, tuple[str, Any]]], name: str) -> list[Any]:
    """Scenario ``name``'s record from every rank of a ``run_scenarios`` run, by rank.

    Fails the calling test with the first failing rank's traceback.
    """
    for rank, results in enumerate(run):
        status, payload = results[name]
        if status != "ok":
            pytest.fail(f"scenario {name!r} raised on rank {rank} of {len(run)}:\n{payload}")
    return [results[name][1] for results in run]


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


@dataclass
class _Child:
    """This child's channels back to the parent and to its peers."""

    conn: Connection
    store: dist.Store


# Set once in each spawned child by _child_main; None in the parent. A module global
# because fn's signature is fixed to (rank, world_size, *args).
_child: _Child | None = None


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    threads_per_rank: int,
    conn: Connection,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads_per_rank)
    try:
        send(conn, run_in_group(fn, rank, world_size, store_path, conn, args))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_group(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    conn: Connection,
    args: tuple[Any, ...],
) -> tuple[str, Any]:
    """Join the gloo group of ``store_path`` and run ``fn``: ``("ok", result)`` or
    ``("error", traceback)``. The group is left for the caller to destroy. Tells the
    parent first if inductor compiled (for `require_full`)."""
    global _child
    graphs = inductor_graphs()
    try:
        store = dist.FileStore(store_path, world_size)
        _child = _Child(conn, store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        message = ("ok", fn(rank, world_size, *args))
    except BaseException:
        message = ("error", traceback.format_exc())
    finally:
        _child = None
    if inductor_graphs() != graphs:
        send(conn, ("inductor", None))
    return message


def send(conn: Connection, message: tuple[str, Any]) -> None:
    """Send ``message`` to the parent; an unpicklable result is sent as an error."""
    try:
        payload = pickle.dumps(message)
    except Exception:
        payload = pickle.dumps(
            ("error", f"could not pickle this rank's result:\n{traceback.format_exc()}")
        )
    conn.send_bytes(payload)


def report_progress(text: str) -> None:
    """Child side: tell the parent what this rank is doing (shown if the run times out)."""
    assert _child is not None, "report_progress is for code run by run_distributed"
    _child.conn.send_bytes(pickle.dumps(("progress", text)))


def run_scenarios(scenarios: dict[str, Callable[[], Any]]) -> dict[str, tuple[str, Any]]:
    """Child side: run each thunk in order; ``{name: ("ok", result) | ("error", traceback)}``.

    A scenario that raises on every rank is recorded and the next one runs, so one bug
    fails one test. After each scenario the ranks meet in the store (not in a collective,
    which would pair up with whatever a stuck rank is blocked on). If a rank raised and
    the others do not arrive, they are blocked in a collective it will never join: it
    raises, so the whole run fails fast with its traceback instead of timing out.
    """
    assert _child is not None, "run_scenarios is for code run by run_distributed"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: dict[str, tuple[str, Any]] = {}
    for name, scenario in scenarios.items():
        report_progress(f"running scenario {name!r}")
        try:
            results[name] = ("ok", scenario())
        except Exception:
            results[name] = ("error", traceback.format_exc())
        _child.store.set(f"scenario/{name}/{rank}", results[name][0])
        keys = [f"scenario/{name}/{r}" for r in range(world_size)]
        try:
            _child.store.wait(keys, timedelta(seconds=_SCENARIO_SYNC_TIMEOUT_S))
        except Exception as exc:
            own = results[name][1] if results[name][0] == "error" else "(this rank passed)"
            raise DistributedError(
                f"scenario {name!r}: other ranks did not finish it within "
                f"{_SCENARIO_SYNC_TIMEOUT_S:.0f}s; this rank's outcome:\n{own}"
            ) from exc
    return results


def end_watchdog(model: torch.nn.Module) -> None:
    """Stop the collective watchdog's threads of ``model``'s root (ours; torch's has
    none), for a run that tracked it with torch's ``MemTracker``: the tracker's hooks,
    held from C++ by autograd nodes, keep the tracked model alive after the run
    (torch's own FSDP states stay alive the same way), and with it those threads,
    which would retire the pool's workers."""
    if hasattr(model, "set_collective_watchdog"):
        model.set_collective_watchdog(False)


# ---------------------------------------------------------------------------
# Single process, fake process group
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int = 0) -> Iterator[DeviceMesh]:
    """A 1D CPU mesh of ``world_size`` ranks in this process, on the ``fake`` backend.

    This process plays ``rank``. Collectives complete without communicating, so only
    metadata (placements, shapes, dtypes) is meaningful. The group is destroyed on exit.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_mesh: a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# torch's own FSDP test helpers, for the scenarios ported from torch's suite
# (tests/runtime/scenarios/) and torch's threaded process group
# (tests/runtime/scenarios/test_threaded_pg.py)
# ---------------------------------------------------------------------------

# Imported on first use (PEP 562): common_fsdp pulls in torch's whole distributed test
# framework, which the other tests' spawned ranks need not pay for.
_TORCH_TEST_EXPORTS = {
    "MLP": "torch.testing._internal.common_fsdp",  # Linear(d, m*d), ReLU, Linear(m*d, d), ReLU
    "MLPStack": "torch.testing._internal.common_fsdp",  # three MLPs, multipliers 3, 4, 3
    "FSDPTest": "torch.testing._internal.common_fsdp",
    "FSDPTestMultiThread": "torch.testing._internal.common_fsdp",  # threaded process group
    "parametrize": "torch.testing._internal.common_utils",  # pytest's cannot reach unittest
    "instantiate_parametrized_tests": "torch.testing._internal.common_utils",
}


def __getattr__(name: str) -> Any:
    if name not in _TORCH_TEST_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_TORCH_TEST_EXPORTS[name]), name)
