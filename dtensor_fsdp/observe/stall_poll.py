"""StallPoller: finds a device collective that never completes, and ends the wait.

[Note: device stalls]
On an accelerator FSDP's waits are stream waits: the host queues them and goes on, so
the bounded host wait of the flight recorder (observe/flight_recorder.py) never runs
out, and a stuck collective (NCCL) would hang the job until the backend's own timeout
(10 minutes by default), inside whatever device synchronization comes next. Which
path a collective takes is decided by what its wait does, as the recorder decides it:
a collective on CPU tensors blocks the host in ``work.wait()``; any other is a stream
wait, whose work the recorder hands here once the wait is queued.

One daemon thread per root and rank, beside the watchdog thread. It sleeps on an event
while no device collective is in flight (no cost), and while some is, it wakes every
deadline/10 and asks each work ``is_completed()`` (a flag read, thread-safe). When the
oldest one is still not completed ``deadline`` after its issue, it runs the same
comparison of every rank's records through the c10d store (observe/watchdog.py), once
per deadline, and on every rank where a device collective is in flight:

- logs the verdict (``logging``, logger ``dtensor_fsdp.observe``): it shows even while
  the main thread is blocked in a device synchronization;
- on an error verdict (ranks diverged, or a backend failure: never silence alone, see
  [Note: no verdict from silence] in diagnosis.py) aborts the process groups of the
  collectives in flight (``ProcessGroup.abort()``, where the backend
  implements it: NCCL's abort ends its kernels, and a synchronization blocked on them
  raises the backend's error) so that the job ends instead of hanging;
- leaves the verdict posted: the main thread's next FSDP collective or wait raises it
  as ``CollectiveMismatchError`` (a straggler's or a slow network's as a warning).
"""

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch.distributed as dist

from .diagnosis import Verdict
from .flight_recorder import CollectiveRecord, FlightRecorder

logger = logging.getLogger("dtensor_fsdp.observe")


def abort_group(group: dist.ProcessGroup) -> bool:
    """``group.abort()`` where the backend implements it (NCCL; ``ProcessGroup.abort``
    is bound since torch 2.6); whether it was aborted."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return False
    try:
        abort()
    except (RuntimeError, NotImplementedError):  # this backend cannot abort
        return False
    return True


class StallPoller:
    """One root's poller of its device collectives in flight on one rank."""

    def __init__(
        self,
        recorder: FlightRecorder,
        abort: Callable[[dist.ProcessGroup], bool] = abort_group,
    ) -> None:
        self._recorder = weakref.ref(recorder)  # the thread must not keep the root alive
        self._rank = recorder.rank
        self._deadline_s = recorder.deadline_s
        self._interval_s = recorder.deadline_s / 10
        self._abort = abort
        # The main thread appends, the thread pops: a deque's ends are thread-safe.
        self._queue: deque[CollectiveRecord] = deque()
        self._watched: list[CollectiveRecord] = []  # the thread's own
        self._wanted = threading.Event()  # set while some work may be in flight
        self._stopped = threading.Event()
        self._next_comparison = 0.0
        # The last comparison round acted on, or that was before the works in flight.
        self._acted_round = -1
        self._thread = threading.Thread(
            target=self._run, name=f"dtensor_fsdp stall poller (rank {self._rank})", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def track(self, record: CollectiveRecord) -> None:
        """The main thread, per device collective once its stream wait is queued."""
        self._queue.append(record)
        if not self._wanted.is_set():
            self._wanted.set()

    def close(self) -> None:
        self._stopped.set()
        self._wanted.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wanted.wait()
            if self._stopped.wait(self._interval_s):
                return
            recorder = self._recorder()
            if recorder is None:
                return
            self.poll(recorder)
            del recorder

    def poll(self, recorder: FlightRecorder) -> None:
        """One look at the works in flight (the thread's, every deadline/10)."""
        if not self._watched and recorder.latest is not None:
            self._acted_round = recorder.latest[0]  # a verdict from before: not theirs
        while self._queue:
            self._watched.append(self._queue.popleft())
        self._watched = [r for r in self._watched if r.is_pending_on_device()]
        if not self._watched:
            # Cleared before looking again: a record tracked meanwhile sets it anew.
            self._wanted.clear()
            if self._queue:
                self._wanted.set()
            return
        now = time.monotonic()
        oldest = min(r.issued_at for r in self._watched)
        if now - oldest >= self._deadline_s and now >= self._next_comparison:
            self._next_comparison = now + self._deadline_s
            recorder.compare_now()
        # Another rank's comparison posts here too, without this rank asking.
        latest = recorder.latest
        if latest is not None and latest[0] > self._acted_round:
            self._acted_round = latest[0]
            self._act(latest[1])

    def _act(self, verdict: Verdict) -> None:
        log = logger.error if verdict.is_error else logger.warning
        log(
            "%s\n(rank %d: found by FSDP's collective watchdog, deadline %g s, polling "
            "its device collectives in flight)",
            verdict.message, self._rank, self._deadline_s,
        )  # fmt: skip
        if not verdict.is_error:
            return
        groups = {id(r.group): r.group for r in self._watched}
        aborted = [g for g in groups.values() if self._abort(g)]
        logger.error(
            "rank %d: aborted %d of %d process group(s) with FSDP collectives in flight; "
            "the next FSDP call raises CollectiveMismatchError",
            self._rank, len(aborted), len(groups),
        )  # fmt: skip
