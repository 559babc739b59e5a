"""The watchdog's threads: compare every rank's flight record through the c10d store.

Two daemon threads per root and rank, started at the root's lazy init (beside the
stall poller of device collectives, observe/stall_poll.py), both idle at no cost while
every wait ends in its first slice:

- The watchdog thread blocks in ``store.wait`` on its own wake key until some rank asks
  for a comparison (a collective outlasted the deadline, or its wait failed:
  observe/flight_recorder.py). The asking rank sets every rank's wake key of the
  current round; each rank's thread then publishes its last records under the round,
  waits up to the answer timeout for the others', reads what a rank that did not
  answer had published itself (below), and runs the same diagnosis
  (observe/diagnosis.py) on what it got, which its main thread raises or warns. A rank
  whose main thread is busy elsewhere (a straggler, or blocked outside FSDP) still
  answers, as long as it does not hold the GIL: only its thread runs.
- The publisher thread sleeps on an event until the main thread asks it to publish
  this rank's records (a host wait outlasted its first slice, or failed), and then
  writes them under one key per rank, overwritten each time. So a rank that cannot
  answer (its GIL held by another thread while it waits; dead after a failure) still
  says what it was waiting for, or how its wait failed.

The store is the default process group's, which still answers when the process group
is stuck. Neither thread's store calls are ever the main thread's: a client whose
server is gone with a dead rank retries for the store's whole timeout. The watchdog
thread has its own connection (``Store.clone``), so that its blocking wait never holds
the other store calls.

Store keys, under ``dtensor_fsdp/watchdog/<tree>/<instance>/``: ``r<round>/wake<rank>``
(``compare`` or, for this rank's thread only, ``stop``), ``r<round>/rank<rank>`` (the
records answered, JSON) and ``published/rank<rank>`` (the records published, JSON).
"""

import json
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..runtime.state import FSDPState
from .diagnosis import RankRecord, Verdict, diagnose
from .flight_recorder import FlightRecorder
from .stall_poll import StallPoller

DEFAULT_DEADLINE = timedelta(seconds=60)
MAX_ANSWER_TIMEOUT = timedelta(seconds=5)
_FOREVER = timedelta(days=365)
_JOIN_TIMEOUT_S = 2.0  # a thread in a comparison may be waiting for answers
_COMPARE, _STOP = b"compare", b"stop"


class Watchdog:
    """The thread of one root on one rank, and the asking side of a comparison."""

    def __init__(
        self,
        stores: tuple[dist.Store, dist.Store],
        recorder: FlightRecorder,
        rank: int,
        world_size: int,
    ) -> None:
        # The main thread's (asking, stopping) and the thread's (blocking waits).
        self._store, self._thread_store = stores
        self._recorder = weakref.ref(recorder)  # the thread must not keep the root alive
        self._rank = rank
        self._world_size = world_size
        self._answer_timeout_s = recorder.answer_timeout_s
        # The round the thread waits for next: advanced as soon as it is woken, so that
        # a request made during a comparison asks for a new one (the verdict on a
        # failure must come from records taken after it).
        self._round = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dtensor_fsdp watchdog (rank {rank})", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def request(self) -> int | None:
        """Ask every rank to publish its records; the round asked for, or None when
        this rank's thread has ended (the store is gone). Called by the main thread,
        which must not block on the store (its server may be gone with a dead rank,
        and a client retries for the store's whole timeout): a short-lived thread
        sets the keys."""
        if not self._thread.is_alive():
            return None
        round_ = self._round
        keys = [f"r{round_}/wake{rank}" for rank in range(self._world_size)]
        threading.Thread(target=self._wake, args=(keys,), daemon=True).start()
        return round_

    def _wake(self, keys: list[str]) -> None:
        try:
            self._store.multi_set(keys, [_COMPARE] * len(keys))
        except (RuntimeError, ValueError):
            pass  # the store is gone: the job is ending

    def close(self) -> None:
        """Stop the thread and wait for it: its root is gone, another watchdog replaces
        it, or the interpreter exits (``weakref.finalize`` runs this at exit too: a
        thread still inside a store call while the process tears down aborts it)."""
        self._stopped.set()
        try:
            self._store.set(f"r{self._round}/wake{self._rank}", _STOP)
        except (RuntimeError, ValueError):
            return  # the store is gone, and the thread with it
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        store = self._thread_store
        while not self._stopped.is_set():
            round_ = self._round
            key = f"r{round_}/wake{self._rank}"
            try:
                store.wait([key], _FOREVER)
                if store.get(key) == _STOP:
                    return
                self._round = round_ + 1
                recorder = self._recorder()
                if recorder is None:
                    return
                verdict = self._compare(store, round_, recorder)
            except (RuntimeError, ValueError):  # the store is gone: the job is ending
                return
            recorder.post(round_, verdict)
            del recorder

    def _compare(self, store: dist.Store, round_: int, recorder: FlightRecorder) -> Verdict:
        store.set(f"r{round_}/rank{self._rank}", json.dumps(recorder.snapshot()))
        keys = [f"r{round_}/rank{rank}" for rank in range(self._world_size)]
        # A rank that did not answer: what it published, if anything, stands in.
        _await_keys(store, keys, self._answer_timeout_s)
        records = _read(store, dict(enumerate(keys)), published=False)
        silent = [rank for rank in range(self._world_size) if rank not in records]
        records |= _read(store, {rank: _published_key(rank) for rank in silent}, published=True)
        return diagnose(records, self._world_size, self._answer_timeout_s)


class Publisher:
    """The thread that publishes one rank's records when its main thread asks."""

    def __init__(self, store: dist.Store, recorder: FlightRecorder) -> None:
        self._store = store
        self._recorder = weakref.ref(recorder)  # the thread must not keep the root alive
        self._key = _published_key(recorder.rank)
        self._wanted = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dtensor_fsdp publisher (rank {recorder.rank})", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """The main thread: publish the records soon (no store call here)."""
        self._wanted.set()

    def close(self) -> None:
        self._stopped.set()
        self._wanted.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            # Cleared before the snapshot: a request made meanwhile publishes anew.
            self._wanted.clear()
            recorder = self._recorder()
            if self._stopped.is_set() or recorder is None:
                return
            snapshot = json.dumps(recorder.snapshot())
            del recorder
            try:
                self._store.set(self._key, snapshot)
            except (RuntimeError, ValueError):
                return  # the store is gone: the job is ending


def _await_keys(store: dist.Store, keys: list[str], timeout_s: float) -> None:
    """Return once every key exists, or after ``timeout_s``. It polls: a rank that
    does not answer is ordinary (a call holding its GIL), and c10d logs two warnings
    for every ``store.wait`` that times out."""
    end = time.monotonic() + timeout_s
    interval = 0.001
    while not store.check(keys) and time.monotonic() < end:
        time.sleep(interval)
        interval = min(2 * interval, 0.05)


def _published_key(rank: int) -> str:
    return f"published/rank{rank}"


def _read(store: dist.Store, keys: dict[int, str], published: bool) -> dict[int, RankRecord]:
    """The records under ``keys`` (by rank) that exist: answers, or records published
    (then with their age, from the wall clock they carry)."""
    present = [key for key in keys.values() if store.check([key])]
    values = store.multi_get(present) if present else []
    now = time.time()
    records = {}
    for value in values:
        data = json.loads(bytes(value))
        age = max(0.0, now - data["at"]) if published else None
        records[data["rank"]] = RankRecord.from_json(data, age)
    return records


def watchdog_factory(
    deadline: timedelta = DEFAULT_DEADLINE,
) -> Callable[[FSDPState], FlightRecorder | None]:
    """What a root runs at lazy init (`FSDPState.make_watchdog`): its flight recorder
    and watchdog thread, with ``deadline``."""
    return lambda root: start_watchdog(root, deadline)


def start_watchdog(root: FSDPState, deadline: timedelta) -> FlightRecorder | None:
    """The root's flight recorder, its watchdog thread started; None with one rank or
    without a store that can be shared with a thread (torch's fake process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        store = distributed_c10d._get_default_store()
        thread_store = store.clone()
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Every rank names the same tree alike: the groups' FQNs, and how many roots of
    # that tree this rank started before (ranks build their roots in the same order).
    tree = zlib.crc32(",".join(g.fqn for s in root.states_in_tree for g in s.groups).encode())
    instance = store.add(f"dtensor_fsdp/watchdog/{tree:08x}/instances/{rank}", 1)
    prefix = f"dtensor_fsdp/watchdog/{tree:08x}/{instance}/"
    stores = (dist.PrefixStore(prefix, store), dist.PrefixStore(prefix, thread_store))
    answer_timeout = min(deadline, MAX_ANSWER_TIMEOUT)
    recorder = FlightRecorder(rank, deadline, answer_timeout)
    start_threads(recorder, stores, world_size)
    return recorder


def start_threads(
    recorder: FlightRecorder, stores: tuple[dist.Store, dist.Store], world_size: int
) -> None:
    """Start ``recorder``'s watchdog thread and stall poller, with ``stores`` (the main
    thread's and the watchdog thread's, one prefix for the ranks of this tree)."""
    watchdog = Watchdog(stores, recorder, recorder.rank, world_size)
    publisher = Publisher(stores[0], recorder)
    poller = StallPoller(recorder)  # device collectives: see [Note: device stalls]
    recorder.request_comparison = watchdog.request
    recorder.publish = publisher.request
    recorder.track = poller.track

    def stop() -> None:
        poller.close()
        publisher.close()
        watchdog.close()

    recorder.stop_watchdog = stop
    weakref.finalize(recorder, stop)
    watchdog.start()
    publisher.start()
    poller.start()
