"""The watchdog thread: compares every rank's flight record through the c10d store.

One daemon thread per root and rank, started at the root's lazy init (beside the stall
poller of device collectives, observe/stall_poll.py). It blocks in
``store.wait`` on its own wake key, at no cost until some rank asks for a comparison
(a collective outlasted the deadline, or its wait failed: observe/flight_recorder.py).
The asking rank sets every rank's wake key of the current round; each rank's thread
then publishes its last records under the round, waits up to the answer timeout for
the others', and runs the same diagnosis (observe/diagnosis.py) on what it got, which
its main thread raises or warns. A rank whose main thread is busy elsewhere (a
straggler, or blocked outside FSDP) still answers: only its thread runs. The store is
the default process group's, which still answers when the process group is stuck; the
thread has its own connection (``Store.clone``), so that its blocking wait never holds
the main thread's store calls.

Store keys, under ``dtensor_fsdp/watchdog/<tree>/<instance>/``: ``r<round>/wake<rank>``
(``compare`` or, for this rank's thread only, ``stop``) and ``r<round>/rank<rank>`` (the
published records, JSON).
"""

import json
import threading
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
        self._answer_timeout = timedelta(seconds=recorder.answer_timeout_s)
        self._round = 0  # the round the thread waits for next
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
                recorder = self._recorder()
                if recorder is None:
                    return
                verdict = self._compare(store, round_, recorder)
            except (RuntimeError, ValueError):  # the store is gone: the job is ending
                return
            self._round = round_ + 1
            recorder.post(round_, verdict)
            del recorder

    def _compare(self, store: dist.Store, round_: int, recorder: FlightRecorder) -> Verdict:
        store.set(f"r{round_}/rank{self._rank}", json.dumps(recorder.snapshot()))
        keys = [f"r{round_}/rank{rank}" for rank in range(self._world_size)]
        try:
            store.wait(keys, self._answer_timeout)
        except RuntimeError:
            pass  # some rank did not answer: the diagnosis names it
        present = [key for key in keys if store.check([key])]
        values = store.multi_get(present) if present else []
        records = [RankRecord.from_json(json.loads(bytes(value))) for value in values]
        return diagnose(
            {r.rank: r for r in records}, self._world_size, self._answer_timeout.total_seconds()
        )


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
    poller = StallPoller(recorder)  # device collectives: see [Note: device stalls]
    recorder.request_comparison = watchdog.request
    recorder.track = poller.track

    def stop() -> None:
        poller.close()
        watchdog.close()

    recorder.stop_watchdog = stop
    weakref.finalize(recorder, stop)
    watchdog.start()
    poller.start()
