"""GlooPools: gloo ranks spawned once per session, reused by many test files.

Spawning a rank costs an interpreter, torch's import and the test module's imports:
seconds on two cores, paid per file by ``run_distributed``. A `WorkerPool` (torch's
``MultiProcContinuousTest`` idea) spawns its W workers at its first ``run`` and keeps
them; ``run(fn, *args)`` sends them the function (by reference, as a spawn does) and
returns what ``run_distributed(fn, W, *args)`` would. The session's `GlooPools` (the
``gloo_pool`` fixture) keeps one pool of 2 ranks and one of 4, each started at its
first use.

What a run finds is what a fresh spawn would give it:

- a process group of its own: a new ``FileStore`` in a new temp directory, joined
  before ``fn`` and destroyed after it (with every group ``fn`` made);
- the process state a spawn starts with, restored before each run (`_ProcessState`:
  RNG states, default dtype, grad and anomaly modes, deterministic algorithms, fp32
  matmul precision, thread count, environment, working directory, ``sys.path``,
  warning filters and their "once" registries, dynamo's caches and counters, DTensor's
  sharding-propagation and redistribution caches, which hold previous runs' meshes);
- no leftovers of a failed run: after an error or a timeout the workers are killed and
  the next run spawns a fresh pair, and a worker that finds Python threads or a
  process group still alive after a run it passed (a watchdog, an async checkpoint
  writer), or a device the run registered (the stand-in accelerator), retires itself
  the same way, with a `PoolRetired` warning that names the run and why (each costs
  the next run a spawn). tqdm's monitor thread, which a progress bar left open keeps
  for the process's life, is stopped instead: the next bar starts another.

What it cannot reset is why some files keep ``run_distributed``'s spawns: modules
imported once stay imported (a test of import side effects), process-wide
registrations (a renamed PrivateUse1 device, a framework's global state); and 1 or 3
ranks, too rare to keep workers for.
"""

import gc
import os
import pickle
import random
import shutil
import sys
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._harness import DEFAULT_TIMEOUT_S, collect, run_in_group, send, stop

# How long the workers may take to start (interpreters, torch's import), apart from a
# run's own timeout: on a loaded machine this alone can take minutes.
_START_TIMEOUT_S = 600.0
# How long a worker waits for a run's Python threads to end before retiring.
_THREAD_GRACE_S = 2.0


class PoolRetired(UserWarning):
    """A run left its workers unfit for the next (a thread, a device): shown in the
    session's warnings summary, since each costs a spawn."""


class GlooPools:
    """The session's pools: one per world size it serves, started at its first run."""

    WORLD_SIZES = (2, 4)

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def serves(self, world_size: int) -> bool:
        return world_size in self.WORLD_SIZES

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on the pool of ``world_size`` ranks."""
        pool = self._pools.setdefault(world_size, WorkerPool(world_size))
        return pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


class WorkerPool:
    """``world_size`` gloo worker processes, spawned at the first `run` and reused."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list[mp.Process] = []
        self._jobs: list[Connection] = []  # parent -> worker, by rank
        self._results: dict[Connection, int] = {}  # worker -> parent
        self.spawns = 0  # how often the workers were started (afresh after a failure)
        self.runs = 0

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on the workers; each rank's result, by rank.

        Args and raises as ``run_distributed`` (timeout: for this run alone).
        """
        if not self._procs:
            self._start()
        store_dir = tempfile.mkdtemp(prefix="dtensor_fsdp_store_")
        job = pickle.dumps((fn, os.path.join(store_dir, "store"), args))
        self.runs += 1
        try:
            for conn in self._jobs:
                conn.send_bytes(job)
            outcome = collect(self._results, self._procs, timeout)
        except BaseException:
            self.close(patience_s=0.0)  # timed out: they may be blocked in a collective
            raise
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
        if outcome.retired:
            reasons = sorted({reason for _, reason in outcome.retired})
            warnings.warn(
                f"the pool's {self.world_size} ranks retired after "
                f"{fn.__module__}.{fn.__qualname__}: {'; '.join(reasons)}; the next run "
                "spawns fresh ones (about 3 s of CPU per rank)",
                PoolRetired,
                stacklevel=2,
            )
        if outcome.errors or outcome.retired:
            self.close(patience_s=0.0 if outcome.errors else 5.0)  # fresh workers next run
        return outcome.results_or_raise(self.world_size)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            job_recv, job_send = ctx.Pipe(duplex=False)
            result_recv, result_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, job_recv, result_send),
                name=f"pool rank{rank}",
                daemon=True,
            )
            proc.start()
            # Our copies of the worker's ends: closed, so that either side's death is EOF.
            job_recv.close()
            result_send.close()
            self._procs.append(proc)
            self._jobs.append(job_send)
            self._results[result_recv] = rank
        self.spawns += 1
        try:
            # Each worker reports once it is up; a run's timeout starts after that.
            started = collect(self._results, self._procs, _START_TIMEOUT_S)
        except BaseException:
            self.close(patience_s=0.0)
            raise
        if started.errors:
            self.close(patience_s=0.0)
        started.results_or_raise(self.world_size)

    def close(self, patience_s: float = 5.0) -> None:
        """End the workers: closing their job pipes lets idle ones exit; those still
        running after ``patience_s`` are killed."""
        for conn in self._jobs:
            conn.close()
        stop(self._procs, patience_s=patience_s)
        for conn in self._results:
            conn.close()
        self._procs, self._jobs, self._results = [], [], {}


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


def _worker_main(rank: int, world_size: int, jobs: Connection, results: Connection) -> None:
    """Run jobs until the parent closes the pipe, or until one leaves this process
    unfit for the next (then retire: the parent spawns a fresh pair)."""
    spawned = _ProcessState.capture()
    send(results, ("ok", None))  # up: see WorkerPool._start
    while True:
        try:
            job = jobs.recv_bytes()
        except EOFError:
            return
        spawned.restore()
        try:
            fn, store_path, args = pickle.loads(job)  # imports the test module
        except BaseException:
            send(results, ("error", f"could not unpickle the job:\n{traceback.format_exc()}"))
            return
        message = run_in_group(fn, rank, world_size, store_path, results, args)
        if message[0] != "ok":
            # The parent retires the pair: the other rank may be blocked in a
            # collective this one will never join.
            send(results, message)
            return
        del fn, args
        leftovers = _leftovers(spawned)
        if leftovers:
            send(results, ("retire", leftovers))
        send(results, message)
        if leftovers:
            return


def _leftovers(spawned: "_ProcessState") -> str:
    """Destroy the run's process groups; what of the run is still alive after that."""
    gc.collect()  # finalizers of the run's models: watchdog threads close here
    if dist.is_initialized():
        dist.destroy_process_group()
    _stop_tqdm_monitor()
    for thread in threading.enumerate():
        if thread.ident not in spawned.threads:
            thread.join(timeout=_THREAD_GRACE_S)
    alive = Counter(t.name for t in threading.enumerate() if t.ident not in spawned.threads)
    if alive:
        names = ", ".join(f"{name!r}" + (f" x {n}" if n > 1 else "") for name, n in alive.items())
        return f"threads still alive after the run: {names}"
    # A renamed PrivateUse1 backend (tests/_standin_device.py) cannot be undone: later
    # runs' DCP and streams would see an accelerator.
    device = torch._C._get_privateuse1_backend_name()
    return f"a device registered by the run: {device}" if device != "privateuseone" else ""


def _stop_tqdm_monitor() -> None:
    """End tqdm's monitor thread, which a progress bar of the run (Hugging Face's,
    Lightning's) starts and which lives until the process ends if a bar was not closed;
    the next bar starts a new one. Left alone, it would retire the workers."""
    monitor = sys.modules.get("tqdm._monitor")
    if monitor is None:
        return
    # By type, not through ``tqdm.tqdm.monitor``: a subclass's bars (``tqdm.auto``'s,
    # Hugging Face's) keep theirs on the subclass. An exited monitor reports itself
    # dead, and the next bar starts a new one.
    for thread in threading.enumerate():
        if isinstance(thread, monitor.TMonitor):
            thread.exit()


@dataclass
class _ProcessState:
    """What a spawned worker starts with, and that a run may change."""

    torch_rng: torch.Tensor
    python_rng: object
    default_dtype: torch.dtype
    deterministic: bool
    matmul_precision: str
    environ: dict[str, str]
    cwd: str
    path: list[str]
    warning_filters: list
    threads: frozenset[int]  # idents of the Python threads alive at spawn

    @classmethod
    def capture(cls) -> "_ProcessState":
        return cls(
            torch.get_rng_state(),
            random.getstate(),
            torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(),
            dict(os.environ),
            os.getcwd(),
            list(sys.path),
            list(warnings.filters),
            frozenset(t.ident for t in threading.enumerate()),
        )

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        torch.set_default_dtype(self.default_dtype)
        # The setter imports inductor's config, and with it dynamo (about 1 s of CPU in
        # a worker whose runs import neither): called only where it has something to
        # undo (a run that called it imported the config, whose flag it also sets).
        if (
            torch.are_deterministic_algorithms_enabled() != self.deterministic
            or "torch._inductor.config" in sys.modules
        ):
            torch.use_deterministic_algorithms(self.deterministic)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_num_threads(1)  # as run_distributed's default threads_per_rank
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        warnings.filters[:] = self.warning_filters
        # Forget which warnings were shown once: a run expecting one must see it.
        warnings._filters_mutated()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        if "torch.distributed.tensor" in sys.modules:
            _forget_dtensor_caches()


def _forget_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribution caches. Their entries
    hold the meshes of the run that filled them, and a mesh finds its process groups
    by name; ``destroy_process_group()`` restarts the names, so the next run's equal
    mesh would be handed a previous run's, whose groups no longer exist ("Could not
    resolve the process group registered under the name 8"), or exist under that name
    as another group."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    # Private, and not checked on torch 2.11 (the GPU machines'): the C++ dispatch's own
    # cache and the tensor-meta one; a torch without them has them not to clear.
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    meta = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if meta is not None:
        meta.cache_clear()
