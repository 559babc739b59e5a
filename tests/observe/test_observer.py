"""The runtime's observer points cost nothing when nothing observes: a step without a
trace or a check reads no clock and records no device timing event."""

import cProfile
import pstats

import torch

from dtensor_fsdp import CommTrace, fully_shard
from dtensor_fsdp.runtime.streams import CommStreams
from tests._harness import fake_mesh
from tests.observe._divergence_job import DIM, Net


class _CountingStreams(CommStreams):
    """The host's streams, counting the device timing events asked of them."""

    def __init__(self) -> None:
        self.timing_events = 0

    def timing_event(self) -> None:
        self.timing_events += 1


def _clock_reads_by_fsdp(step) -> int:
    """``time.perf_counter`` calls made by dtensor_fsdp's own code during ``step()``."""
    profiler = cProfile.Profile()
    profiler.runcall(step)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return sum(
        calls
        for (_, _, name), (_, _, _, _, callers) in stats.items()
        if "perf_counter" in name
        for (caller_file, _, _), (calls, *_) in callers.items()
        if "dtensor_fsdp" in caller_file
    )


def test_step_without_observers_reads_no_clock() -> None:
    with fake_mesh(2, rank=0) as mesh:
        model = Net([24, 32, 40])
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, DIM)).backward()  # lazy init
        streams = _CountingStreams()
        model._get_fsdp_state().ctx.streams = streams

        def step() -> None:
            model(torch.randn(2, DIM)).backward()

        assert _clock_reads_by_fsdp(step) == 0
        assert streams.timing_events == 0
        # The control: with a trace, every collective is timed at its issue and wait.
        trace = CommTrace()
        model.set_comm_trace(trace)
        assert _clock_reads_by_fsdp(step) > 0
        assert trace.events and streams.timing_events > 0
