"""The bounded host wait of the flight recorder (observe/flight_recorder.py), in one
process: a collective that completes after its slice ran out is a completed one, a rank
that gives no answer draws a warning while the wait goes on, a backend failure is
logged before anything waits for the other ranks, and only a wait that outlasts its
first slice publishes anything to the store.

Each "rank" is a flight recorder with its real watchdog threads on one in-memory c10d
store (as the ranks of a job share the default group's store); its collectives are host
collectives (CPU tensors: the recorder waits in slices) whose works are fakes with
gloo's ``wait(timeout)`` contract: "timed out" when the slice ends first, the backend's
error once failed. torch's FSDP2 waits in ``work.wait()`` (nothing to bound): the
torchrun jobs against torch are in test_no_false_alarm.py.
"""

import json
import logging
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

SLICE = timedelta(milliseconds=1)
CLOSED = "Connection closed by peer [127.0.0.1]:1234. This is typically caused by a remote"


class HostWork:
    """A host collective's work that completes during its ``slices``-th slice, after
    the slice ran out (the race: gloo's timed wait raised "timed out", and the work was
    complete by the next look), then succeeds or fails with ``error``."""

    def __init__(self, slices: int, error: str | None = None) -> None:
        self.slices = slices
        self.error = error
        self.completed = False
        self.timed_waits = 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.completed and timeout is not None:
            self.timed_waits += 1
            time.sleep(timeout.total_seconds())
            self.completed = self.timed_waits >= self.slices
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class FakeGroup:
    group_name = "0"


def _record(recorder: FlightRecorder, fqn: str = "blocks.0") -> CollectiveRecord:
    collective = Collective(
        "all_gather", fqn, "forward", FakeGroup(), 2, torch.device("cpu"), 1024, CommStreams()
    )  # type: ignore[arg-type]
    recorder.before_issue(collective)
    record = recorder.issuing(collective)
    record.waiting()
    return record


def _recorder(rank: int, deadline_s: float = 60.0, answer_s: float = 5.0) -> FlightRecorder:
    recorder = FlightRecorder(rank, timedelta(seconds=deadline_s), timedelta(seconds=answer_s))
    recorder.slice = SLICE  # the test-only knob: the slice is min(deadline / 10, 0.5 s)
    return recorder


@pytest.mark.parametrize("slices", [1, 3], ids=["first-slice", "later-slice"])
def test_a_collective_that_completes_after_its_slice_ran_out_is_completed(slices: int) -> None:
    recorder = _recorder(0)
    for _ in range(200):
        record = _record(recorder)
        record.wait(HostWork(slices))  # type: ignore[arg-type]
        record.waited(1024, "forward")
    assert recorder.stalls == 200
    assert recorder.snapshot()["error"] is None


def test_a_failed_collective_raises_the_backends_error() -> None:
    recorder = _recorder(0)  # no watchdog threads: nobody to compare with
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _record(recorder).wait(HostWork(1, error=CLOSED))  # type: ignore[arg-type]
    assert recorder.snapshot()["entries"][-1][7] == "failed"


class Ranks:
    """Flight recorders with their threads on one store; each rank's recorder as the
    runtime builds it, but with a 1 ms slice."""

    def __init__(self, store: dist.Store, ranks: list[int], world_size: int, **times) -> None:
        self.recorders = {rank: _recorder(rank, **times) for rank in ranks}
        for recorder in self.recorders.values():
            start_threads(recorder, (store, store), world_size)

    def close(self) -> None:
        for recorder in self.recorders.values():
            assert recorder.stop_watchdog is not None
            recorder.stop_watchdog()


def test_a_wait_publishes_only_once_it_outlasts_its_first_slice() -> None:
    store = dist.HashStore()
    ranks = Ranks(store, [0], 2)
    try:
        recorder = ranks.recorders[0]
        _record(recorder).wait(HostWork(0))  # type: ignore[arg-type]  # done at once
        time.sleep(0.2)
        assert store.num_keys() == 0  # the healthy wait made no store call
        _record(recorder, "blocks.1").wait(HostWork(5))  # type: ignore[arg-type]
        deadline = time.monotonic() + 5.0
        while not store.check(["published/rank0"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        published = json.loads(store.get("published/rank0"))
        assert [row[2] for row in published["entries"]] == ["blocks.0", "blocks.1"]
    finally:
        ranks.close()


def test_a_rank_that_gives_no_answer_draws_a_warning_and_the_wait_goes_on() -> None:
    # Rank 1 never answers (busy in a call that holds the GIL): rank 0's wait outlasts
    # three deadlines, then its collective completes.
    deadline_s = 0.2
    ranks = Ranks(dist.HashStore(), [0], 2, deadline_s=deadline_s, answer_s=deadline_s)
    try:
        record = _record(ranks.recorders[0])
        work = HostWork(int(3 * deadline_s / SLICE.total_seconds()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record.wait(work)  # type: ignore[arg-type]  # no error
        assert work.completed
        messages = [str(w.message) for w in caught if w.category is CollectiveStragglerWarning]
        assert messages and all(
            m.startswith("FSDP straggler: rank(s) [1] gave no answer within 0.2 s")
            for m in messages
        ), messages
    finally:
        ranks.close()


def test_a_backend_failure_is_logged_before_the_ranks_are_compared(caplog) -> None:
    """Rank 1 answers the comparison only once rank 0 has logged its backend error: the
    verdict comes well before the answer timeout only if the log came first."""
    store = dist.HashStore()
    answer_s = 60.0
    ranks = Ranks(store, [0], 2, answer_s=answer_s)
    peer = _recorder(1)  # no threads: rank 1 answers only when the test lets it
    _record(peer).wait(HostWork(0))  # type: ignore[arg-type]

    class AnswerOnLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "failed in the backend" in record.getMessage():
                store.set("r0/rank1", json.dumps(peer.snapshot()))

    handler = AnswerOnLog()
    logger = logging.getLogger("dtensor_fsdp.observe")
    logger.addHandler(handler)
    try:
        start = time.monotonic()
        with (
            caplog.at_level(logging.ERROR, logger="dtensor_fsdp.observe"),
            pytest.raises(CollectiveMismatchError) as error,
        ):
            _record(ranks.recorders[0]).wait(HostWork(1, error=CLOSED))  # type: ignore
        assert time.monotonic() - start < answer_s / 2
        assert caplog.messages[0].startswith(
            "rank 0: FSDP's all_gather #0 of 'blocks.0' in forward (1,024 B) at step 0 failed "
            f"in the backend: RuntimeError: {CLOSED}"
        ), caplog.messages
        assert "the backend failed the wait of rank(s) [0]" in str(error.value)
        assert isinstance(error.value.__cause__, RuntimeError)
    finally:
        logger.removeHandler(handler)
        ranks.close()


def test_the_backends_timeout_ends_the_wait_for_a_silent_rank() -> None:
    """The bound on a rank that never answers is the backend's own: gloo fails the
    collective at the process group's timeout, which is evidence, and the verdict says
    what is known."""
    deadline_s = 0.2
    ranks = Ranks(dist.HashStore(), [0], 2, deadline_s=deadline_s, answer_s=deadline_s)
    timed_out = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600ms for recv"
    try:
        work = HostWork(int(3 * deadline_s / SLICE.total_seconds()), error=timed_out)
        with (
            warnings.catch_warnings(record=True) as caught,
            pytest.raises(CollectiveMismatchError) as error,
        ):
            warnings.simplefilter("always")
            _record(ranks.recorders[0]).wait(work)  # type: ignore[arg-type]
        assert any("rank(s) [1] gave no answer" in str(w.message) for w in caught)
        assert str(error.value).startswith(
            "FSDP collective failed: the backend failed the wait of rank(s) [0]; rank(s) [1] "
            "stopped answering"
        ), str(error.value)
        assert f"the backend raised: RuntimeError: {timed_out}" in str(error.value)
    finally:
        ranks.close()
