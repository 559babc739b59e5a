"""CommTrace's summary and Chrome-trace export."""

import json
from pathlib import Path

from dtensor_fsdp import CommEvent, CommTrace, DeviceTiming, LifecycleEvent


def _trace() -> CommTrace:
    trace = CommTrace()
    trace.events += [
        CommEvent("all_gather", "layers.0", 4, 4000, start_s=1.0, wait_s=1.5, end_s=1.75, phase="forward"),
        CommEvent("all_gather", "layers.0", 4, 4000, start_s=2.0, wait_s=2.0, end_s=2.25, phase="backward"),
        CommEvent("reduce_scatter", "layers.0", 4, 4000, start_s=3.0, wait_s=3.5, end_s=3.5, phase="backward"),
        CommEvent("all_reduce", "", 2, 100, start_s=4.0, wait_s=4.0, end_s=4.5, phase="backward"),
    ]
    trace.lifecycle.append(LifecycleEvent("unshard", "layers.0", "forward"))
    return trace


def test_summary_per_step_by_kind() -> None:
    summary = _trace().summary(steps=2)
    assert summary["all_gather"] == {"count": 1.0, "nbytes": 4000.0, "wire_bytes": 3000.0, "exposed_s": 0.25}
    assert summary["reduce_scatter"] == {"count": 0.5, "nbytes": 2000.0, "wire_bytes": 1500.0, "exposed_s": 0.0}
    # A ring all-reduce sends twice (W-1)/W of its buffer.
    assert summary["all_reduce"]["wire_bytes"] == 50.0
    assert _trace().schedule() == [("unshard", "layers.0", "forward")]


def test_chrome_trace_export(tmp_path: Path) -> None:
    path = tmp_path / "comm.json"
    _trace().export_chrome_trace(str(path))
    records = json.loads(path.read_text())["traceEvents"]
    assert [(r["name"], r["ts"], r["dur"]) for r in records[:2]] == [
        ("all_gather (layers.0)", 0.0, 750000.0),
        ("all_gather (layers.0)", 1e6, 250000.0),
    ]
    assert records[3]["name"] == "all_reduce (root)" and records[3]["args"]["exposed_us"] == 500000.0


def test_clear() -> None:
    trace = _trace()
    trace.clear()
    assert trace.events == [] and trace.lifecycle == []


class _Event:
    """A device timing event at a fixed time on a fake device clock (seconds)."""

    def __init__(self, time_s: float) -> None:
        self.time_s = time_s
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: "_Event") -> float:
        return (end.time_s - self.time_s) * 1e3  # milliseconds, as torch.Event's


def test_device_timing_is_the_compute_streams_stall(tmp_path: Path) -> None:
    # On an accelerator the host's wait returns at once (wait_s == end_s): the exposed
    # time comes from the device events, issued at 10 s, reached at 10.5 s, done 10.75 s.
    timing = DeviceTiming(_Event(10.0), _Event(10.5), _Event(10.75))
    stalled = CommEvent("all_gather", "layers.0", 4, 4000, 1.0, 1.2, 1.2, "forward", timing)
    hidden = CommEvent(
        "all_gather", "layers.1", 4, 4000, 2.0, 2.2, 2.2, "forward",
        DeviceTiming(_Event(11.0), _Event(11.5), _Event(11.25)),  # done before compute got there
    )  # fmt: skip
    assert stalled.exposed_s == 0.25 and timing.done.synchronized
    assert hidden.exposed_s == 0.0
    assert DeviceTiming.of(None, _Event(0.0), lambda: _Event(1.0)) is None  # not tracing there
    trace = CommTrace(events=[stalled, hidden])
    assert trace.summary()["all_gather"]["exposed_s"] == 0.25
    path = tmp_path / "comm.json"
    trace.export_chrome_trace(str(path))
    records = json.loads(path.read_text())["traceEvents"]
    device = [(r["name"], r["ts"], r["dur"]) for r in records if r["pid"] == 1]
    assert device == [("all_gather (layers.0)", 0.0, 750000.0), ("all_gather (layers.1)", 1e6, 250000.0)]
    assert len([r for r in records if r["pid"] == 0]) == 2
