"""The stall poller of device collectives (observe/stall_poll.py), in one process.

On an accelerator FSDP's waits are stream waits that never block the host, so only the
poller finds a collective that never completes (NCCL cannot run here). Each "rank" is a
flight recorder with its real watchdog thread and poller, all sharing one in-memory
c10d store (as the ranks of a job share the default group's store); its collectives
are device collectives (CUDA tensors: a stream wait) whose works are fakes that
complete when the test says so, and whose process group records its ``abort()``.
torch's FSDP2 has no such path (it waits for the backend's timeout): nothing to compare.
"""

import gc
import json
import logging
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dtensor_fsdp import CollectiveMismatchError, CollectiveStragglerWarning
from dtensor_fsdp.observe.flight_recorder import CollectiveRecord, FlightRecorder
from dtensor_fsdp.observe.watchdog import start_threads
from dtensor_fsdp.runtime.observer import Collective
from dtensor_fsdp.runtime.streams import CommStreams

DEADLINE_S = 0.4
ANSWER_TIMEOUT_S = 0.4  # a rank without records is named after this
SETTLE_S = 5.0  # far more than deadline + answer timeout + a poll: no verdict rests on time


class FakeWork:
    """A device collective's work: its stream wait returns at once."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class FakeGroup:
    """A process group whose backend implements abort (as NCCL's)."""

    group_name = "0"

    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def _collective(group: FakeGroup, fqn: str) -> Collective:
    return Collective(
        "all_gather", fqn, "forward", group, 2, torch.device("cuda"), 1024, CommStreams()
    )  # type: ignore[arg-type]


class Rank:
    """One rank's recorder and threads, and its device collectives."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.group = FakeGroup()
        self.recorder = FlightRecorder(
            rank, timedelta(seconds=DEADLINE_S), timedelta(seconds=ANSWER_TIMEOUT_S)
        )
        self.comparisons = 0
        start_threads(self.recorder, (store, store), world_size)
        request = self.recorder.request_comparison
        assert request is not None

        def counted() -> int | None:
            self.comparisons += 1
            return request()

        self.recorder.request_comparison = counted

    def issue_and_wait(self, fqn: str) -> FakeWork:
        """Issue an all-gather of ``fqn`` and queue its (stream) wait, as the runtime."""
        collective = _collective(self.group, fqn)
        self.recorder.before_issue(collective)
        record = self.recorder.issuing(collective)
        assert isinstance(record, CollectiveRecord) and record.waits
        work = FakeWork()
        record.waiting()
        record.wait(work)  # type: ignore[arg-type]
        record.waited(1024, "forward")
        return work

    def close(self) -> None:
        assert self.recorder.stop_watchdog is not None
        self.recorder.stop_watchdog()


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def _until(condition, timeout_s: float = SETTLE_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_diverged_ranks_abort_their_groups_and_raise(store, caplog) -> None:
    ranks = [Rank(store, r, 2) for r in range(2)]
    try:
        # Rank 1 skipped block 0: both device all-gathers hang (as NCCL would).
        ranks[0].issue_and_wait("blocks.0")
        ranks[1].issue_and_wait("blocks.1")
        with caplog.at_level(logging.ERROR, logger="dtensor_fsdp.observe"):
            assert _until(lambda: all(r.group.aborted for r in ranks)), "no abort"
        # Logged on each rank from its poller, even while its main thread is blocked.
        logged = [m for m in caplog.messages if "FSDP ranks diverged" in m]
        assert any("(rank 0:" in m for m in logged) and any("(rank 1:" in m for m in logged)
        for rank in ranks:  # the main thread's next FSDP call raises the verdict
            with pytest.raises(CollectiveMismatchError, match=r"rank\(s\) \[1\] issued"):
                rank.issue_and_wait("blocks.2")
    finally:
        for rank in ranks:
            rank.close()


def test_a_silent_rank_is_warned_not_aborted(store, caplog) -> None:
    """Silence alone is no evidence (rank 1 may be busy in a call that holds the GIL):
    the poller warns, naming it, and aborts nothing."""
    survivor = Rank(store, 0, 2)  # rank 1 publishes nothing and never answers
    try:
        waiting = survivor.issue_and_wait("blocks.0")
        with caplog.at_level(logging.WARNING, logger="dtensor_fsdp.observe"):
            assert _until(lambda: any("gave no answer" in m for m in caplog.messages))
        assert "FSDP straggler: rank(s) [1] gave no answer within 0.4 s" in caplog.text
        waiting.done = True  # rank 1 came back
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            survivor.issue_and_wait("blocks.1").done = True  # no error
        assert [w.category for w in caught] == [CollectiveStragglerWarning]
        assert survivor.group.aborted == 0
    finally:
        survivor.close()


def test_a_rank_whose_backend_failed_is_named(store) -> None:
    """A backend failure is evidence: rank 1's wait failed, it published that and is
    gone; the survivor's poller aborts and its next FSDP call raises."""
    dead = FlightRecorder(1, timedelta(seconds=DEADLINE_S), timedelta(seconds=ANSWER_TIMEOUT_S))
    dead.issuing(_collective(FakeGroup(), "blocks.0")).state = "failed"
    dead._error = "RuntimeError: Connection closed by peer"  # as `failed` records it
    store.set("published/rank1", json.dumps(dead.snapshot()))
    survivor = Rank(store, 0, 2)
    try:
        survivor.issue_and_wait("blocks.0")
        assert _until(lambda: survivor.group.aborted == 1), "no abort"
        with pytest.raises(CollectiveMismatchError) as error:
            survivor.issue_and_wait("blocks.1")
        assert "the backend failed the wait of rank(s) [1]; rank(s) [1] stopped" in str(error.value)
        assert "Connection closed by peer" in str(error.value)
    finally:
        survivor.close()


def test_a_straggler_is_warned_not_aborted(store, caplog) -> None:
    ranks = [Rank(store, r, 2) for r in range(2)]
    try:
        waiting = ranks[0].issue_and_wait("blocks.0")
        ranks[1].issue_and_wait("blocks.0").done = True  # rank 1 is busy after it
        with caplog.at_level(logging.WARNING, logger="dtensor_fsdp.observe"):
            assert _until(lambda: ranks[0].recorder.latest is not None)
            assert _until(lambda: any("FSDP straggler" in m for m in caplog.messages))
        waiting.done = True  # rank 1 caught up
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranks[0].issue_and_wait("blocks.1").done = True  # no error
        assert [w.category for w in caught] == [CollectiveStragglerWarning]
        assert ranks[0].group.aborted == 0 and ranks[1].group.aborted == 0
    finally:
        for rank in ranks:
            rank.close()


def test_collectives_that_complete_are_never_compared(store) -> None:
    ranks = [Rank(store, r, 2) for r in range(2)]
    try:
        for step in range(3):
            works = [rank.issue_and_wait(f"blocks.{step}") for rank in ranks]
            time.sleep(DEADLINE_S / 2)
            for work in works:
                work.done = True
        time.sleep(2 * DEADLINE_S)  # past the deadline of the last, completed ones
        assert [rank.comparisons for rank in ranks] == [0, 0]
        assert [rank.recorder.latest for rank in ranks] == [None, None]
    finally:
        for rank in ranks:
            rank.close()


def test_a_dropped_recorder_ends_its_threads(store) -> None:
    """The poller keeps the records of the collectives it follows (here one that never
    completes); they must not keep the recorder alive: a root the user drops (its
    recorder with it) ends its three threads, as graph mode's launches showed."""
    recorder = FlightRecorder(
        0, timedelta(seconds=DEADLINE_S), timedelta(seconds=ANSWER_TIMEOUT_S)
    )
    start_threads(recorder, (store, store), 1)
    collective = _collective(FakeGroup(), "blocks.0")
    recorder.before_issue(collective)
    record = recorder.issuing(collective)
    assert isinstance(record, CollectiveRecord)
    work = FakeWork()  # never completes: the poller follows it until the end
    record.wait(work)  # type: ignore[arg-type]
    assert len(_threads()) == 3, _threads()  # the watchdog, the publisher, the poller
    del recorder, record
    gc.collect()
    assert _until(lambda: not _threads()), _threads()


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dtensor_fsdp ")]
