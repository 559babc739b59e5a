"""CommTrace: a user-visible record of what FSDP communicated, and when.

A trace is installed on a root module with ``FSDPModule.set_comm_trace(trace)``. The
scheduler then appends one ``CommEvent`` per collective (kind, module FQN, group size,
bytes, issue and completion times) and one ``LifecycleEvent`` per lifecycle step
(``unshard``, ``reshard``, ``post_backward``...). Tests read the schedule from here
instead of patching internals; users export it to Perfetto or summarize it.

Times are host times (``time.perf_counter``): ``start_s`` when the collective was issued
and ``end_s`` when the wait for it returned. On an accelerator the wait is a stream
wait, so ``end_s`` bounds when the host *could* proceed, not when the kernel finished.
"""

import json
from dataclasses import dataclass, field
from typing import Any


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
    """

    kind: str
    fqn: str
    group_size: int
    nbytes: int
    start_s: float
    wait_s: float
    end_s: float
    phase: str

    @property
    def exposed_s(self) -> float:
        """Host time spent blocked on this collective: what overlap did not hide."""
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
        """Write the collectives as a Chrome/Perfetto trace (one track per kind)."""
        if not self.events:
            records: list[dict[str, Any]] = []
        else:
            origin = min(event.start_s for event in self.events)
            records = [
                {
                    "name": f"{event.kind} ({event.fqn or 'root'})",
                    "ph": "X",
                    "ts": (event.start_s - origin) * 1e6,
                    "dur": (event.end_s - event.start_s) * 1e6,
                    "pid": 0,
                    "tid": event.kind,
                    "args": {
                        "nbytes": event.nbytes,
                        "group_size": event.group_size,
                        "exposed_us": event.exposed_s * 1e6,
                    },
                }
                for event in self.events
            ]
        with open(path, "w") as f:
            json.dump({"traceEvents": records}, f)
