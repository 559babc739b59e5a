"""FlightRecorder: every rank's ring buffer of FSDP's collectives, and the bounded wait.

On by default (``FSDPModule.set_collective_watchdog``). Per collective the recorder
keeps, in a ring of the last ``capacity``: the process group, the per-group sequence
number, the module's FQN, the phase, the kind, the bytes, the step (the how-manieth
forward after a backward) and its state (issued, waiting, done, failed). Recording is a
few attribute writes and one clock read on this rank: no collective, no store round
trip. The records are compared only when something is wrong (observe/watchdog.py).

[Note: how a stuck rank is made to raise]
A thread cannot interrupt the main thread while it blocks inside a c10d ``wait()``:
Python delivers an asynchronous exception or a signal only between bytecodes, and
gloo's ``ProcessGroup.abort()`` (torch 2.13) does not wake a waiting ``wait()``
(measured: the wait ends only when the peer's connection closes). So the recorder
waits in the runtime's place (`CollectiveWatch.wait`): a host collective (CPU tensors:
gloo) is waited in slices, ``work.wait(timeout)``, which gloo ends with "timed out"
and lets wait again. A wait that ends in one slice, as every healthy one, costs what
``work.wait()`` costs. A wait that outlasts its first slice has this rank publish its
records to the store (from the watchdog's publisher thread: the main thread never
calls the store), so that the others can read them without this rank's help. Past
the deadline the main thread asks the watchdog thread for a comparison of every
rank's records, and raises an error verdict between two slices: only on positive
evidence (see [Note: no verdict from silence], diagnosis.py); a rank that gives no
answer draws a warning and the wait goes on. When the wait itself fails (gloo closes
the connection of a rank that died, or its own timeout, the process group's, runs
out) the main thread logs the backend's error at once, then asks for the comparison
and raises ``CollectiveMismatchError`` from the backend's error. On an accelerator
(any tensors but CPU ones) FSDP's wait is a stream wait that does not block the host:
the recorder lets it through and hands the work to the stall poller
(observe/stall_poll.py), which finds a collective that does not complete by the
deadline with ``Work.is_completed()`` and ends it.

[Note: a collective that completes after its slice ran out]
``work.wait(slice)`` raises "timed out" when the slice ends first, and the collective
may complete between that and the next look (gloo: 7 of 4,442 timed-out 1 ms waits had
completed by then). A completed work is not a failed one: it is waited once more,
which returns at once when it succeeded and raises the backend's own error when it
failed (`_wait_slice`).
"""

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..runtime.observer import Collective, CollectiveWatch, CommObserver, GraphLaunch
from .consistency import CollectiveMismatchError, CollectiveSignature
from .diagnosis import Verdict

DEFAULT_CAPACITY = 256  # collectives kept per rank (a few steps of a large model)
PUBLISHED = 32  # of those, the last ones a rank publishes when asked
MAX_SLICE_S = 0.5  # the longest slice of a host wait (a verdict waits at most this)

logger = logging.getLogger("dtensor_fsdp.observe")


class CollectiveStragglerWarning(RuntimeWarning):
    """Some ranks are behind the others at an FSDP collective; their records agree."""


class CollectiveRecord(CollectiveWatch):
    """One collective in the ring; its own watch (state changes at its wait)."""

    def __init__(
        self, recorder: "FlightRecorder", group: dist.ProcessGroup, seq: int, c: Collective
    ) -> None:
        # Weakly: the stall poller keeps the records of device collectives and graph
        # launches until it next looks, and its thread must not keep the recorder (nor
        # the root that owns it) alive: a dropped model's threads end with it.
        self._recorder = weakref.ref(recorder)
        self.group = group  # named only when published: the name is a C++ call
        self.seq = seq
        self.fqn = c.fqn
        self.phase = c.phase
        self.kind = c.kind
        self.nbytes = c.nbytes
        self.step = recorder.step
        self.state = "issued"
        self.issued_at = time.monotonic()
        # On the host a wait blocks: bound it. On an accelerator it is a stream wait,
        # and its work is polled (set at the wait).
        self.blocks_host = c.device.type == "cpu"
        self.work: dist.Work | None = None

    waits = True  # the runtime's wait goes through `wait`

    @property
    def recorder(self) -> "FlightRecorder":
        recorder = self._recorder()
        assert recorder is not None, "a collective outlived its root's flight recorder"
        return recorder

    def waiting(self) -> None:
        self.state = "waiting"

    def waited(self, nbytes: int, phase: str) -> None:
        self.state = "done"

    def wait(self, work: dist.Work) -> None:
        """See [Note: how a stuck rank is made to raise]."""
        if not self.blocks_host:
            self.recorder.wait_on_device(self, work)
            return
        try:
            work.wait(self.recorder.slice)
            return
        except RuntimeError as error:
            if _cannot_time_out(error):
                # A work type without timed waits (torch's threaded test group): wait
                # unbounded, as the runtime would without the recorder.
                work.wait()
                return
        # The slice ran out, or the wait failed: see [Note: a collective that
        # completes after its slice ran out].
        self.recorder.wait_stalled(self, work)

    # Graph mode (runtime/observer.py): the stall poller follows a compiled graph's
    # collectives as it follows device ones; a failure inside the graph is compared.
    def in_graph(self, launch: GraphLaunch) -> None:
        self.recorder.wait_on_device(self, launch)  # type: ignore[arg-type]

    def failed(self, error: RuntimeError) -> None:
        self.recorder.failed(self, error)

    def is_pending_on_device(self) -> bool:
        """Whether this is a device collective whose stream wait was queued and whose
        work has not completed (thread-safe: ``Work.is_completed`` only reads)."""
        return self.work is not None and not self.work.is_completed()

    def describe(self) -> str:
        signature = CollectiveSignature(self.seq, self.fqn, self.phase, self.kind, self.nbytes)
        return f"{signature.describe()} at step {self.step}"

    def row(self, now: float, state: str) -> list[Any]:
        """As published (diagnosis.Entry's fields)."""
        return [
            self.group.group_name, self.seq, self.fqn, self.phase, self.kind, self.nbytes,
            self.step, state, round(now - self.issued_at, 3),
        ]  # fmt: skip


class FlightRecorder(CommObserver):
    """One root's record of its collectives, and the bounded wait of the stuck ones."""

    def __init__(self, rank: int, deadline: timedelta, answer_timeout: timedelta) -> None:
        """
        Args:
            rank: this process's global rank.
            deadline: how long a host waits in one collective before the ranks compare
                their records.
            answer_timeout: how long a comparison waits for the other ranks' records.
        """
        self.rank = rank
        self.deadline_s = deadline.total_seconds()
        self.answer_timeout_s = answer_timeout.total_seconds()
        self.slice = timedelta(seconds=min(self.deadline_s / 10, MAX_SLICE_S))
        self.step = 0
        self._in_backward = False
        self._ring: list[CollectiveRecord | None] = [None] * DEFAULT_CAPACITY
        self._next = 0
        self._seq: dict[dist.ProcessGroup, int] = {}
        # Set by the watchdog (observe/watchdog.py): asks every rank to publish its
        # records; returns the round it asked for, or None if the store is gone.
        self.request_comparison: Callable[[], int | None] | None = None
        self.stop_watchdog: Callable[[], None] | None = None  # ends the thread
        self._error: str | None = None  # this rank's backend error, for the others
        # Set by the watchdog: publishes this rank's records from a thread of its own
        # (the main thread never calls the store); called when a wait stalls or fails.
        self.publish: Callable[[], None] | None = None
        self.stalls = 0  # host waits whose first slice ended without them
        self._failure: Verdict | None = None  # raised once, then again at each collective
        # The watchdog thread posts verdicts here, the main thread takes them.
        self._posted = threading.Condition()
        self._verdict: Verdict | None = None
        self._posted_round = -1
        # The last posted comparison (round, verdict): read, never taken, by the poller.
        self.latest: tuple[int, Verdict] | None = None
        # Set by start_watchdog: receives each device collective once its stream wait
        # is queued (observe/stall_poll.py).
        self.track: Callable[[CollectiveRecord], None] | None = None

    # Recording (the main thread, per collective) #

    def before_issue(self, collective: Collective) -> None:
        if self._verdict is not None or self._failure is not None:
            self.raise_verdict()

    def issuing(self, collective: Collective) -> CollectiveRecord:
        group = collective.group
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        if collective.phase == "backward":
            self._in_backward = True
        elif collective.phase == "forward" and self._in_backward:
            self._in_backward = False
            self.step += 1
        record = CollectiveRecord(self, group, seq, collective)
        self._ring[self._next % DEFAULT_CAPACITY] = record
        self._next += 1
        return record

    def wait_on_device(self, record: CollectiveRecord, work: dist.Work) -> None:
        """A device collective's wait: raise a verdict the poller's comparison posted,
        queue the stream wait (the host goes on), hand the work to the poller."""
        if self._verdict is not None or self._failure is not None:
            self.raise_verdict()
        work.wait()
        record.work = work
        if self.track is not None:
            self.track(record)

    # Stalls and failures (the main thread, off the hot path) #

    def wait_stalled(self, record: CollectiveRecord, work: dist.Work) -> None:
        """Wait on for a collective whose first slice ended without it: publish this
        rank's records, past each deadline ask for a comparison, and raise the first
        error verdict posted (a warning's is warned, and the wait goes on)."""
        self.stalls += 1
        if self._finished(record, work, None):
            return
        if self.publish is not None:
            self.publish()
        next_comparison = record.issued_at + self.deadline_s
        while True:
            self.raise_verdict()
            now = time.monotonic()
            if now >= next_comparison and self.request_comparison is not None:
                self.request_comparison()
                next_comparison = now + self.deadline_s
            if self._finished(record, work, self.slice):
                return

    def _finished(
        self, record: CollectiveRecord, work: dist.Work, timeout: timedelta | None
    ) -> bool:
        """Whether ``work`` completed, waiting up to ``timeout`` for it (None: only
        look); when it failed, what `failed` raises."""
        try:
            return _wait_slice(work, timeout)
        except RuntimeError as error:
            self.failed(record, error)
            raise

    def failed(self, record: CollectiveRecord, error: RuntimeError) -> None:
        """The backend failed ``record``'s wait: log its error at once (a launcher may
        end this process any moment: torchrun does, seconds after another rank
        exited), publish it, compare with the other ranks and raise what they say,
        from ``error``; return (the caller re-raises ``error``) when nobody can be
        asked or no verdict came."""
        record.state = "failed"
        first_line = str(error).splitlines()[0] if str(error) else ""
        self._error = f"{type(error).__name__}: {first_line[:300]}"
        logger.error(
            "rank %d: FSDP's %s failed in the backend: %s\nComparing the flight records "
            "of every rank (up to %g s); the verdict is raised next",
            self.rank, record.describe(), self._error, self.answer_timeout_s,
        )  # fmt: skip
        if self.publish is not None:
            self.publish()
        verdict = self.compare_now()
        if verdict is not None and verdict.is_error:
            try:
                self.raise_verdict()
            except CollectiveMismatchError as mismatch:
                raise mismatch from error

    def compare_now(self) -> Verdict | None:
        """Ask every rank for a comparison and wait for its verdict (None: nobody can
        be asked, or no verdict within the answer timeout)."""
        asked = self.request_comparison() if self.request_comparison is not None else None
        if asked is None:
            return None
        with self._posted:
            self._posted.wait_for(
                lambda: self._posted_round >= asked, timeout=self.answer_timeout_s + 5.0
            )
            return self._verdict if self._posted_round >= asked else None

    def raise_verdict(self) -> None:
        """Raise an error verdict (again at every later collective: the process group
        is stuck), warn a straggler verdict once."""
        with self._posted:
            verdict, self._verdict = self._verdict, None
        if verdict is not None and verdict.is_error:
            self._failure = verdict
        elif verdict is not None:
            warnings.warn(verdict.message, CollectiveStragglerWarning, stacklevel=2)
        if self._failure is not None:
            raise CollectiveMismatchError(
                f"{self._failure.message}\nFound by FSDP's collective watchdog (deadline "
                f"{self.deadline_s:g} s, FSDPModule.set_collective_watchdog). Collectives "
                "are still pending on this process group, which cannot be used again: "
                "end the job (torchrun --max-restarts resumes it from the last checkpoint)"
            )

    # The watchdog thread #

    def snapshot(self) -> dict[str, Any]:
        """This rank's last collectives, oldest first, as published."""
        now = time.monotonic()
        ring, count = list(self._ring), self._next
        start = max(0, count - PUBLISHED)
        records = [r for r in (ring[i % DEFAULT_CAPACITY] for i in range(start, count)) if r]
        rows = [
            r.row(now, state) for r, state in zip(records, _published_states(records), strict=True)
        ]
        return {"rank": self.rank, "entries": rows, "error": self._error, "at": time.time()}

    def post(self, round_: int, verdict: Verdict) -> None:
        """The verdict of comparison ``round_`` (a straggler's is not an error)."""
        with self._posted:
            if verdict.is_error or self._verdict is None:
                self._verdict = verdict
            self.latest = (round_, verdict)
            self._posted_round = max(self._posted_round, round_)
            self._posted.notify_all()


def _wait_slice(work: dist.Work, timeout: timedelta | None) -> bool:
    """Wait for ``work`` up to ``timeout`` (None: only look): True once it completed,
    False when it had not; raises the backend's error when it failed. See [Note: a
    collective that completes after its slice ran out]."""
    if timeout is not None:
        try:
            work.wait(timeout)
            return True
        except RuntimeError:
            pass  # timed out, or failed: a completed work says which below
    if not work.is_completed():
        return False
    work.wait()  # completed: returns at once, or raises the backend's error
    return True


def _cannot_time_out(error: RuntimeError) -> bool:
    """Whether ``work.wait(timeout)`` failed because this work type has no timed wait
    (``FutureWrappingWork``, behind torch's threaded process group: "wait() with finite
    timeout not implemented"), not because the collective timed out or failed."""
    return "finite timeout not implemented" in str(error)


def _published_states(records: list[CollectiveRecord]) -> list[str]:
    """Each record's state as published. A host record's is what its wait left. A
    device record whose stream wait was queued is done once its work completed; the
    oldest one not completed is the one the device waits for ("waiting", as a host
    blocked in it), the later ones queue behind it ("issued")."""
    states = []
    waiting_seen = False
    for record in records:
        state = record.state
        if record.work is not None and state != "failed":
            if record.work.is_completed():
                state = "done"
            else:
                state = "issued" if waiting_seen else "waiting"
                waiting_seen = True
        states.append(state)
    return states
