"""The deferred-execution stream backend (tests/_deferred_streams.py) on its own: each
hazard it models shows up without the wait that orders it, and only the right wait
removes it. tests/runtime/streams/test_streams.py runs FSDP's scheduling code through it."""

import gc

import torch

from dtensor_fsdp.runtime.streams import StreamRole
from tests._deferred_streams import DeferredStreams

AG, AR = StreamRole.ALL_GATHER, StreamRole.ALL_REDUCE


def test_side_writes_read_as_poison_until_compute_waits_for_their_event() -> None:
    streams = DeferredStreams()
    x = torch.arange(4.0)
    with streams.running():
        with streams.on(AG):
            y = x * 2
            z = y + 1  # the same stream sees its own writes
            as_bytes = torch.zeros(4, dtype=torch.uint8)
            as_bytes.add_(1)
        assert y.isnan().all() and z.isnan().all()
        assert (as_bytes == 255).all()  # 0xFF: NaN through any float view
        event = streams.record_on(AG)
        streams.wait_for_event(AR, event)  # another side stream: not ordered for compute
        streams.wait_for_compute(AG)  # the wrong direction
        assert z.isnan().all()
        streams.wait_for_event(None, event)
        assert torch.equal(z, x * 2 + 1) and (as_bytes == 1).all()


def test_an_event_releases_only_the_writes_before_it_and_join_releases_all() -> None:
    streams = DeferredStreams()
    with streams.running():
        with streams.on(AR):
            first = torch.ones(2)
        event = streams.record_on(AR)
        with streams.on(AR):
            second = torch.ones(2)
        streams.wait_for_event(None, event)
        assert torch.equal(first, torch.ones(2)) and second.isnan().all()
        streams.join(AR)
        assert torch.equal(second, torch.ones(2))


def test_a_side_read_of_compute_writes_it_did_not_wait_for_is_poisoned_for_good() -> None:
    streams = DeferredStreams()
    with streams.running():
        source = torch.zeros(3)
        streams.wait_for_compute(AR)  # sees `source` as allocated
        source.add_(1)  # compute writes after that wait
        with streams.on(AR):
            stale = source * 2
        streams.join(AR)
        assert stale.isnan().all() and streams.stale_reads == 1
        streams.wait_for_event(AR, streams.record_compute())
        with streams.on(AR):
            fresh = source * 2
        streams.join(AR)
        assert torch.equal(fresh, torch.full((3,), 2.0)) and streams.stale_reads == 1


def test_freeing_side_memory_before_waiting_for_compute_reads_is_a_hazard() -> None:
    streams = DeferredStreams()
    with streams.running():
        for wait in (False, True):
            with streams.on(AG):
                output = torch.ones(3)
            streams.join(AG)
            copied = output.clone()  # compute reads it (the copy-out)
            if wait:
                streams.wait_for_event(AG, streams.record_compute())
            del output
            gc.collect()
            assert torch.equal(copied, torch.ones(3))
    assert len(streams.hazards) == 1, streams.hazards


def test_dropped_waits_are_ignored() -> None:
    streams = DeferredStreams(dropped=frozenset({("compute", "ALL_GATHER")}))
    with streams.running():
        with streams.on(AG):
            y = torch.ones(2)
        streams.wait_for_event(None, streams.record_on(AG))
        assert y.isnan().all()
