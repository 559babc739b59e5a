"""CommObserver: how extras watch FSDP's collectives without living in the runtime.

Tracing, device timing and the cross-rank checks (``dtensor_fsdp/observe/``) need to
see every collective at three points and every lifecycle step; the runtime owns this
interface and calls whatever observers a group has attached, never the extras
themselves (runtime/ imports nothing from observe/). With none attached a call point
costs one truth test of a tuple: no clock read, no event, no record is built.

Per collective the runtime calls, in this order:

1. ``before_issue(collective)``: nothing is issued yet; an observer may raise here
   (the checks do, on every rank alike) and the collective is then never issued.
2. ``issuing(collective)``, right before the collective is enqueued, on the stream it
   is issued from: an observer returns a `CollectiveWatch` to follow this one
   collective to its wait (or None). The runtime keeps the watches with the work in
   flight, so a collective is followed by the observers attached when it was issued.
3. ``watch.waiting()`` when its result is first needed, just before the wait, then
   ``watch.waited(nbytes, phase)`` right after it (``nbytes``: the buffer that was
   communicated, known only once issued; ``phase``: the group's phase at the wait).
   The wait itself is ``wait_work``: a watch whose ``waits`` is true waits in the
   runtime's place (``watch.wait(work)``), so that it can bound a wait that never
   ends and raise instead (the flight recorder's watchdog, observe/watchdog.py).

``lifecycle(step, fqn, phase)`` marks a group's steps (FSDP2's verbs: ``unshard``,
``reshard``, ``reshard_post_forward``, ``pre_backward``, ``post_backward``).

Graph mode (dtensor_fsdp/graph) runs its collectives inside compiled graphs: at each
graph's launch it calls steps 1 and 2 for every collective the graph holds, in the
graph's order, then ``watch.waiting()`` and ``watch.in_graph(launch)``: the collectives
are waited inside the graph, where no observer can wait in the runtime's place, and
``launch.is_completed()`` turns true when the graph returns (then ``watch.waited``). If
the graph raises, ``watch.failed(error)`` lets an observer raise a clearer error.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .streams import CommStreams


@dataclass(frozen=True)
class UnshardedGrads:
    """What a gradient reduce-scatter carries: per parameter its FQN and its unsharded
    grad (in the same order on every rank), and the dtype the collective reduces in."""

    names: list[str]
    grads: list[torch.Tensor]
    reduce_dtype: torch.dtype


@dataclass(frozen=True)
class Collective:
    """One FSDP collective about to be issued, as the runtime describes it."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    fqn: str  # the group's ('' for the root)
    phase: str  # at the issue: "forward", "backward" or "explicit" (a user's unshard())
    group: dist.ProcessGroup
    group_size: int  # ranks in ``group``
    device: torch.device  # where the collective's tensors live
    # What this rank contributes: the all-gather input, the gradients in the reduce
    # dtype, the all-reduce's parts (the wire may carry them encoded).
    nbytes: int
    streams: CommStreams  # the root's streams: device timing events come from here
    grads: UnshardedGrads | None = None  # a reduce-scatter's gradients


class GraphLaunch:
    """The run of one compiled graph, as an observer follows the collectives inside it
    (the part of ``dist.Work`` it may call: ``is_completed``, ``wait``)."""

    def __init__(self) -> None:
        self.returned = False

    def is_completed(self) -> bool:
        return self.returned

    def wait(self, timeout: object = None) -> bool:
        """Nothing to wait for here: the graph waits for its own collectives."""
        return True


class CollectiveWatch:
    """An observer's follower of one issued collective (see the module docstring)."""

    def waiting(self) -> None:
        """The collective's result is needed now; its wait starts."""

    def waited(self, nbytes: int, phase: str) -> None:
        """The wait returned (on an accelerator: the compute stream now waits)."""

    # Whether `wait` replaces the runtime's ``work.wait()`` for this collective.
    waits = False

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work`` (called instead of ``work.wait()`` when ``waits``); may
        raise to end a wait that does not end."""
        work.wait()

    def in_graph(self, launch: GraphLaunch) -> None:
        """The collective runs inside a compiled graph (graph mode), waited there; the
        graph has returned once ``launch.is_completed()``. An observer that bounds
        waits follows it from another thread."""

    def failed(self, error: RuntimeError) -> None:
        """The compiled graph that held the collective raised ``error`` (a backend's:
        a peer died, sizes mismatched); an observer may raise a clearer error from it.
        Returning lets the runtime raise ``error``."""


class CommObserver:
    """Watches one root's (or subtree's) collectives and lifecycle steps; every method
    is a no-op here, so an observer overrides only the points it needs."""

    def lifecycle(self, step: str, fqn: str, phase: str) -> None:
        """Group ``fqn`` performs lifecycle ``step`` in ``phase``."""

    def before_issue(self, collective: Collective) -> None:
        """Before anything of ``collective`` is issued; raising abandons it."""

    def issuing(self, collective: Collective) -> CollectiveWatch | None:
        """``collective`` is enqueued next: a watch to follow it to its wait, or None."""
        return None


Observers = tuple[CommObserver, ...]
Watches = tuple[CollectiveWatch, ...]


def check_collective(observers: Observers, collective: Collective) -> None:
    """Step 1 for every observer (may raise)."""
    for observer in observers:
        observer.before_issue(collective)


def watch_collective(observers: Observers, collective: Collective) -> Watches:
    """Step 2 for every observer: the watches to keep with the work in flight."""
    watches = (observer.issuing(collective) for observer in observers)
    return tuple(watch for watch in watches if watch is not None)


def observe_issue(observers: Observers, collective: Collective) -> Watches:
    """Steps 1 and 2, for a collective with no lifecycle step between them."""
    check_collective(observers, collective)
    return watch_collective(observers, collective)


def begin_wait(watches: Watches) -> None:
    for watch in watches:
        watch.waiting()


def wait_work(work: dist.Work, watches: Watches) -> None:
    """``work.wait()``, or the first watch that waits in its place (see the module
    docstring, step 3)."""
    for watch in watches:
        if watch.waits:
            watch.wait(work)
            return
    work.wait()


def end_wait(watches: Watches, nbytes: int, phase: str) -> None:
    for watch in watches:
        watch.waited(nbytes, phase)
