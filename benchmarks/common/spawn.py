"""Run a function on W real gloo ranks from a plain ``python`` script, for benchmarks
that compare several world sizes in one launch (torchrun gives one world size).

Each rank joins through a ``FileStore`` in a fresh temp directory (no ports) and writes
its pickled result to a file; the parent reads the files, never the exit codes: gloo
workers sometimes abort at interpreter exit after their work is done ("terminate
called without an active exception"), so a rank that wrote its result has passed.
"""

import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(fn: Callable[[], Any], world_size: int, timeout_s: float = 600.0) -> list[Any]:
    """``fn()`` on ``world_size`` spawned gloo ranks (the default group is initialized
    when it runs); each rank's return value, by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died without a
            result, or did not finish within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="bench_spawn_")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, folder), daemon=True)
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        outcomes = _wait_for_results(procs, folder, timeout_s)
        # A failed rank first: the others are then only blocked, waiting for it.
        for rank, outcome in enumerate(outcomes):
            if outcome is not None and not outcome[0]:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{outcome[1]}")
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                raise RuntimeError(
                    f"rank {rank} of {world_size} left no result within {timeout_s:.0f} s "
                    f"(exit code {procs[rank].exitcode}; see its stderr)"
                )
        return [value for _, value in outcomes]
    finally:
        for proc in procs:
            proc.join(timeout=2)  # a rank that wrote its result is leaving on its own
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_results(
    procs: list[mp.Process], folder: str, timeout_s: float
) -> list[tuple[bool, Any] | None]:
    """Each rank's (ok, value), or None for a rank with no result; returns early once a
    rank failed (the others are then blocked in a collective it will never join) or
    every rank is done."""
    deadline = time.monotonic() + timeout_s
    outcomes: list[tuple[bool, Any] | None] = [None] * len(procs)
    while time.monotonic() < deadline:
        for rank in range(len(procs)):
            path = os.path.join(folder, f"rank{rank}.pkl")
            if outcomes[rank] is None and os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        failed = any(o is not None and not o[0] for o in outcomes)
        exited = all(o is not None or not p.is_alive() for o, p in zip(outcomes, procs))
        if failed or exited:
            break
        time.sleep(0.2)
    return outcomes


def _rank_main(fn: Callable[[], Any], rank: int, world_size: int, folder: str) -> None:
    # One thread per rank, so that W ranks on a small machine do not oversubscribe it.
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        outcome = (True, fn())
    except Exception:  # noqa: BLE001 - any failure goes to the parent, with its traceback
        outcome = (False, traceback.format_exc())
    # Written whole, then renamed: the parent never reads half a result.
    path = os.path.join(folder, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)
    if outcome[0]:
        dist.destroy_process_group()
