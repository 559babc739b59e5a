"""How the GPU check runs a row without letting it stop the others: its ranks as
spawned processes, or its commands as subprocesses, each under a deadline, with their
output in log files.

Ranks (``run_ranks``) join their group themselves (``join_group``), so a row can do
work before it (``plan()`` needs a process without a default group). Each rank writes
its pickled result to a file, and the parent reads the files, never the exit codes:
gloo workers sometimes abort at interpreter exit after their work is done ("terminate
called without an active exception"). ``benchmarks/common/spawn.py`` is the same idea for CPU benchmarks; it
joins a gloo group before the function runs and leaves the output on the terminal,
where four ranks' warnings would bury the table.

On one GPU: W=1 runs NCCL. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so W > 1 runs gloo with CUDA tensors, every rank on device 0: real
asynchronous collectives beside FSDP's CUDA streams (their timings are host-copy bound).
"""

import dataclasses
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
_GRACE_AFTER_ERROR_S = 3.0  # the other ranks' chance to report their own error first
_LOG_TAIL_LINES = 12


class RowError(RuntimeError):
    """A rank raised, died without a result, or the row ran past its deadline."""


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Where one rank of a row runs."""

    rank: int
    world_size: int
    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    store_path: str
    artifacts: str  # a folder for the files the row leaves (profiler traces)
    quick: bool


def join_group(spec: RankSpec) -> torch.device:
    """Join the row's process group; every rank uses CUDA device 0 on CUDA."""
    device = torch.device("cpu")
    if spec.device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    store = dist.FileStore(spec.store_path, spec.world_size)
    # NCCL: connect now (device_id), not at the first collective inside a timed step.
    extra = {"device_id": device} if spec.backend == "nccl" else {}
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, **extra
    )
    return device


def run_ranks(
    fn: Callable[..., Any], specs: list[RankSpec], logs: list[Path], timeout_s: float
) -> list[Any]:
    """``fn(spec)`` on one spawned process per spec; each rank's return value, by rank.

    Raises:
        RowError: with the first failing rank's traceback, or on timeout with what each
            rank logged last; every rank is killed by then.
    """
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="gpu_check_ranks_")
    results = [os.path.join(folder, f"rank{s.rank}.pkl") for s in specs]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, spec, result, str(log)), daemon=True)
        for spec, result, log in zip(specs, results, logs, strict=True)
    ]
    outcomes: list[tuple[bool, Any] | None] = [None] * len(procs)
    try:
        for proc in procs:
            proc.start()
        outcomes = _wait(procs, results, timeout_s)
    finally:
        # Ranks that all reported are leaving on their own; otherwise the others are
        # blocked in a collective (or hung): kill them now.
        finished = all(o is not None and o[0] for o in outcomes)
        _stop(procs, patience_s=5.0 if finished else 0.0)
        shutil.rmtree(folder, ignore_errors=True)
    for rank, outcome in enumerate(outcomes):
        if outcome is not None and not outcome[0]:
            error = outcome[1].strip().splitlines()[-1]
            raise RowError(f"rank {rank} of {len(specs)}: {error}\n{outcome[1]}")
    missing = [rank for rank, outcome in enumerate(outcomes) if outcome is None]
    if missing:
        tails = "\n".join(f"rank {r} log:\n{log_tail(logs[r])}" for r in missing)
        raise RowError(
            f"ranks {missing} left no result within {timeout_s:.0f} s (killed; exit codes "
            f"{[procs[r].exitcode for r in missing]})\n{tails}"
        )
    return [outcome[1] for outcome in outcomes]


def _wait(procs: list[Any], results: list[str], timeout_s: float) -> list[tuple[bool, Any] | None]:
    """Each rank's (ok, value), or None; returns once every rank is done or gone, or a
    short grace after the first failure (the others are then blocked in a collective)."""
    deadline = time.monotonic() + timeout_s
    outcomes: list[tuple[bool, Any] | None] = [None] * len(procs)
    while True:
        # Whether all are gone is asked before reading: a rank that wrote its file and
        # exited in between is read in this pass.
        gone = all(not proc.is_alive() for proc in procs)
        for rank, path in enumerate(results):
            if outcomes[rank] is None and os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        if gone or all(o is not None for o in outcomes) or time.monotonic() >= deadline:
            return outcomes
        if any(o is not None and not o[0] for o in outcomes):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        time.sleep(0.1)


def _stop(procs: list[Any], patience_s: float) -> None:
    deadline = time.monotonic() + patience_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _rank_main(fn: Callable[..., Any], spec: RankSpec, result: str, log: str) -> None:
    # The rank's output goes to its log (warnings of four ranks would bury the table).
    with open(log, "ab", buffering=0) as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # Ranks share the machine's cores: one thread each on a small CPU machine.
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // spec.world_size)))
    try:
        outcome = (True, fn(spec))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent, with its traceback
        traceback.print_exc()
        outcome = (False, traceback.format_exc())
    with open(result + ".tmp", "wb") as f:  # written whole, then renamed
        pickle.dump(outcome, f)
    os.replace(result + ".tmp", result)
    if outcome[0] and dist.is_initialized():
        dist.destroy_process_group()


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class Finished:
    """One command's end: its exit code (None: killed at the deadline) and output."""

    returncode: int | None
    output: str
    seconds: float


def run_commands(commands: list[list[str]], logs: list[Path], timeout_s: float) -> list[Finished]:
    """Run ``commands`` side by side from the repo root, each in its own process session
    (a kill at the deadline reaches torchrun's workers too); their output in ``logs``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # With the launcher's rendezvous store shared, a worker can read a stale
        # rendezvous (after a restart: the dead group's addresses) and hang.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    start = time.monotonic()
    running = []
    for command, log in zip(commands, logs, strict=True):
        with open(log, "w") as sink:
            running.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    codes: list[int | None] = []
    for proc in running:
        try:
            codes.append(proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)
    elapsed = time.monotonic() - start
    return [
        Finished(code, log.read_text(errors="replace"), elapsed) for code, log in zip(codes, logs)
    ]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (their sockets are open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def torchrun(script: str, *args: str, port: int) -> list[str]:
    """A one-process torchrun launch of ``script`` (a path from the repo root)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", script, *args,
    ]  # fmt: skip
