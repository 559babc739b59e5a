"""CommTrace: a user-visible record of what FSDP communicated, and when.

A trace is installed on a root module with ``FSDPModule.set_comm_trace(trace)``. The
runtime then appends one ``CommEvent`` per collective (kind, module FQN, group size,
bytes, issue and completion times) and one ``LifecycleEvent`` per lifecycle step
(``unshard``, ``reshard``, ``post_backward``...). Tests read the schedule from here
instead of patching internals; users export it to Perfetto or summarize it.

Times are host times (``time.perf_counter``): ``start_s`` when the collective was issued
and ``end_s`` when the wait for it returned. On the host (gloo) the wait blocks, so
``end_s - wait_s`` is exposed communication. On an accelerator the wait is a stream
wait that returns at once; each event then also carries `DeviceTiming`, three device
events (issued on the issuing stream; compute reached the wait; the wait was over), and
``exposed_s`` is the time the compute stream really stalled on the collective.
Resolving device times synchronizes with those events, so read them after the step.

`TraceObserver` is how the runtime fills a trace: ``set_comm_trace`` attaches one to
every group (runtime/observer.py), so a run without a trace reads no clock at all.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..runtime.observer import Collective, CollectiveWatch, CommObserver
from ..runtime.streams import CommStreams


@dataclass(frozen=True)
class DeviceTiming:
    """Device events of one collective (``torch.Event(enable_timing=True)`` or alike).

    Attributes:
        issued: recorded on the issuing stream just before the collective.
        waited: recorded on the compute stream where it first needed the result.
        done: recorded on the compute stream right after its wait for the collective.
    """

    issued: Any
    waited: Any
    done: Any

    @staticmethod
    def of(issued: Any, waited: Any, record: Callable[[], Any]) -> "DeviceTiming | None":
        """The timing of a collective whose ``issued``/``waited`` events exist (tracing
        on an accelerator); ``record()`` records ``done`` now. None otherwise."""
        if issued is None or waited is None:
            return None
        return DeviceTiming(issued, waited, record())

    def exposed_s(self) -> float:
        """How long the compute stream stalled on the collective."""
        self.done.synchronize()
        return max(0.0, self.waited.elapsed_time(self.done)) / 1e3

    def span_s(self, origin: Any) -> tuple[float, float]:
        """(issued, done) in seconds after the device event ``origin``. ``done`` bounds
        the collective's end from above: it is when compute had waited for it."""
        self.done.synchronize()
        return origin.elapsed_time(self.issued) / 1e3, origin.elapsed_time(self.done) / 1e3


@dataclass(frozen=True)
class CommEvent:
    """One collective issued by FSDP.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        fqn: fully-qualified name of the ``fully_shard`` module ('' for the root).
        group_size: ranks in the process group the collective ran over.
        nbytes: bytes of the unsharded buffer: all-gather output, reduce-scatter input.
        start_s: host time the collective was issued.
        wait_s: host time the wait for it began (when its result was first needed).
        end_s: host time its wait returned; ``end_s - wait_s`` is exposed communication.
        phase: ``"forward"``, ``"backward"`` or ``"explicit"`` (a user ``unshard()``).
        device: its device events on an accelerator, None on the host.
    """

    kind: str
    fqn: str
    group_size: int
    nbytes: int
    start_s: float
    wait_s: float
    end_s: float
    phase: str
    device: DeviceTiming | None = None

    @property
    def exposed_s(self) -> float:
        """Time compute was blocked on this collective, what overlap did not hide: the
        compute stream's stall on an accelerator, the host's wait elsewhere."""
        if self.device is not None:
            return self.device.exposed_s()
        return self.end_s - self.wait_s

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends for this collective with a ring algorithm."""
        factor = 2 if self.kind == "all_reduce" else 1
        return factor * (self.group_size - 1) / self.group_size * self.nbytes


@dataclass(frozen=True)
class LifecycleEvent:
    """One lifecycle step of one group, e.g. ``("unshard", "layers.0", "forward")``."""

    event: str
    fqn: str
    phase: str


@dataclass
class CommTrace:
    """Collects ``CommEvent`` and ``LifecycleEvent`` records from every group of a root."""

    events: list[CommEvent] = field(default_factory=list)
    lifecycle: list[LifecycleEvent] = field(default_factory=list)

    def clear(self) -> None:
        self.events.clear()
        self.lifecycle.clear()

    def schedule(self) -> list[tuple[str, str, str]]:
        """Lifecycle and collective issue order as ``(event, fqn, phase)`` tuples."""
        return [(e.event, e.fqn, e.phase) for e in self.lifecycle]

    def summary(self, steps: int = 1) -> dict[str, Any]:
        """Per step, by kind: collectives, bytes, ring wire bytes, exposed wait seconds."""
        per_kind: dict[str, dict[str, float]] = {}
        for event in self.events:
            entry = per_kind.setdefault(
                event.kind, {"count": 0, "nbytes": 0, "wire_bytes": 0.0, "exposed_s": 0.0}
            )
            entry["count"] += 1
            entry["nbytes"] += event.nbytes
            entry["wire_bytes"] += event.wire_bytes
            entry["exposed_s"] += event.exposed_s
        return {
            kind: {name: value / steps for name, value in entry.items()}
            for kind, entry in per_kind.items()
        }

    def export_chrome_trace(self, path: str) -> None:
        """Write the collectives as a Chrome/Perfetto trace (one track per kind): host
        times, and on an accelerator device times in a second process ("device")."""
        records: list[dict[str, Any]] = []
        if self.events:
            origin = min(event.start_s for event in self.events)
            records += [
                _chrome_record(event, 0, event.start_s - origin, event.end_s - origin)
                for event in self.events
            ]
        timed = [(e, e.device) for e in self.events if e.device is not None]
        if timed:
            device_origin = min(timed, key=lambda pair: pair[0].start_s)[1].issued
            records += [
                _chrome_record(event, 1, *device.span_s(device_origin)) for event, device in timed
            ]
        with open(path, "w") as f:
            json.dump({"traceEvents": records}, f)


def _chrome_record(event: CommEvent, pid: int, start_s: float, end_s: float) -> dict[str, Any]:
    return {
        "name": f"{event.kind} ({event.fqn or 'root'})",
        "ph": "X",
        "ts": start_s * 1e6,
        "dur": (end_s - start_s) * 1e6,
        "pid": pid,  # 0: host times; 1: device times
        "tid": event.kind,
        "args": {
            "nbytes": event.nbytes,
            "group_size": event.group_size,
            "exposed_us": event.exposed_s * 1e6,
        },
    }


class TraceObserver(CommObserver):
    """Appends every collective and lifecycle step of the groups it is attached to
    to ``trace`` (``FSDPModule.set_comm_trace``)."""

    def __init__(self, trace: CommTrace) -> None:
        self.trace = trace

    def lifecycle(self, step: str, fqn: str, phase: str) -> None:
        self.trace.lifecycle.append(LifecycleEvent(step, fqn, phase))

    def issuing(self, collective: Collective) -> CollectiveWatch:
        return _CommEventWatch(self.trace, collective)


class _CommEventWatch(CollectiveWatch):
    """One collective's `CommEvent` in the making: host times at the issue and around
    the wait, and on an accelerator a device event at each (see `DeviceTiming`)."""

    def __init__(self, trace: CommTrace, collective: Collective) -> None:
        self.trace = trace
        self.kind = collective.kind
        self.fqn = collective.fqn
        self.group_size = collective.group_size
        self.streams: CommStreams = collective.streams
        # On the issuing stream, right before the collective is enqueued.
        self.start_s = time.perf_counter()
        self.issued_event = self.streams.timing_event()
        self.wait_s = 0.0  # the wait's start, and its device event: `waiting`
        self.waited_event: Any = None

    def waiting(self) -> None:
        self.wait_s = time.perf_counter()
        self.waited_event = self.streams.timing_event()

    def waited(self, nbytes: int, phase: str) -> None:
        self.trace.events.append(
            CommEvent(
                kind=self.kind,
                fqn=self.fqn,
                group_size=self.group_size,
                nbytes=nbytes,
                start_s=self.start_s,
                wait_s=self.wait_s,
                end_s=time.perf_counter(),
                phase=phase,
                device=DeviceTiming.of(
                    self.issued_event, self.waited_event, self.streams.timing_event
                ),
            )
        )
