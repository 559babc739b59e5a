"""CommStreams: where FSDP's communication runs relative to compute.

Collectives are always issued asynchronously (``async_op=True``) and waited where their
result is first needed; what differs between devices is what "issued" and "waited" mean.

- **Host** (CPU devices: gloo, torch's threaded test group, the fake group): a
  collective runs on the backend's own threads from the moment it is issued, and
  ``work.wait()`` blocks the host. Nothing else is needed: `CommStreams` itself, whose
  stream methods do nothing.
- **Accelerator** (`DeviceStreams`: CUDA/NCCL and any device with torch's stream API):
  a collective runs on the backend's internal stream, which waits, at issue, for
  everything queued on the stream that is current *then*; ``work.wait()`` makes the
  current stream (not the host) wait for it. Issued from the compute stream, the next
  group's all-gather would wait for this group's compute, which the host has already
  queued. So, as in torch's FSDP2, FSDP's own all-gathers (copy-in, host-to-device copy
  of offloaded shards, the collective) run on a side stream, and HSDP's replicate
  all-reduces on another, each ordered with the compute stream only where data flows:

  ==========================================  ========================================
  dependency                                  where
  ==========================================  ========================================
  all-gathers read what the optimizer wrote   the root's pre-forward: ``wait_for_compute``
                                              (or the user's post-optimizer event)
  copy-out (compute) reads what the           an event recorded on the all-gather stream
  all-gather stream wrote: H2D copy,          after the all-gather, waited by compute
  copy-in, a custom all-gather's kernels;     (every shard size, whatever ``Work``
  and the collective itself                   exists); ``work.wait()`` for the collective
  the next all-gathers may reuse the          the copy-out's event, waited by the
  output's memory                             all-gather stream: in forward (implicit
                                              unshards) at the next group's copy-out, so
                                              all-gather i+1 overlaps copy-out i and
                                              block i's compute (one more output alive,
                                              as in torch); otherwise right away
  hpZ: the backward all-gather reads the      an event recorded at post-forward, waited
  post-forward buffer                         by the side stream at the backward unshard
  the all-reduce reads the reduce-scatter     an event recorded on the compute stream
  input (its output at shard size 1) and      after the reduce-scatter was issued,
  the partial sums compute wrote              waited by the all-reduce stream; and
                                              ``work.wait()`` there for the collective
  compute frees what the all-reduce read      ``join`` after issuing it
  a user's all-reduce hook stream reads       ``on_user_stream``: that stream waits for
  the reduced gradients; they land after      compute before the hook, compute for it
  the hook                                    after
  ==========================================  ========================================

  Reduce-scatters need no side stream: issued from the compute stream right after the
  gradients, they wait for exactly those gradients, and later compute overlaps them on
  the backend's stream.

Both backends serve the same scheduling code (param_group.py, reduction/), so every
call site reads as the dependency it expresses, and the CPU test suite runs the same
decisions the GPU runs. CPU offload's device-to-host gradient copies and timing events
(`CommTrace` on a GPU) go through here for the same reason; tests substitute an
instrumented backend (a slow copy, fake timing events).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch


class StreamRole(Enum):
    """A side stream, by the work it runs."""

    ALL_GATHER = auto()  # FSDP's own unshards: H2D copies, copy-in, the all-gather
    ALL_REDUCE = auto()  # HSDP: the replicate-axis all-reduce and what feeds it


class CommStreams:
    """The host backend, and the interface every backend implements: on a CPU device
    there are no streams, a collective's ``work.wait()`` blocks the host, and each
    method here is the no-op (or the plain copy) that correctly stands for it."""

    # Whether work runs on streams that must be ordered; without them FSDP frees
    # buffers as soon as the host is done with them (no deferred release).
    has_streams = False

    @contextmanager
    def on(self, role: StreamRole | None) -> Iterator[None]:
        """Run the enclosed work (allocations included) on ``role``'s stream; ``None``
        keeps the current (compute) stream."""
        yield

    @contextmanager
    def on_user_stream(self, stream: Any) -> Iterator[None]:
        """Run the enclosed work on a stream the user gave (``set_all_reduce_hook``'s),
        after everything queued on the compute stream so far and before anything the
        compute stream queues next; ``None`` keeps the current stream."""
        yield

    def wait_for_compute(self, role: StreamRole) -> None:
        """``role``'s stream waits for everything queued on the compute stream so far."""

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        """``role``'s stream (``None``: the compute stream) waits for ``event`` (from
        `record_compute`, `record_on`, or a user's ``torch.Event``)."""
        if event is not None:
            event.wait()

    def join(self, role: StreamRole) -> None:
        """The compute stream waits for everything queued on ``role``'s stream so far."""

    def record_compute(self) -> Any:
        """An event marking the compute stream's work queued so far, or None."""
        return None

    def record_on(self, role: StreamRole) -> Any:
        """An event marking ``role``'s stream's work queued so far, or None."""
        return None

    def copy_to_host(self, tensor: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
        """``tensor`` copied to host memory as ``dtype`` (CPU offload's sharded grads).

        With ``non_blocking`` the copy may still be running when this returns: the
        caller must `wait_on_host` an event recorded after it before the host reads it.
        """
        return tensor.to(device="cpu", dtype=dtype, non_blocking=non_blocking)

    def wait_on_host(self, event: Any) -> None:
        """Block the host until ``event`` (from `record_compute`) has happened."""

    def timing_event(self) -> Any:
        """A timing event recorded on the current stream, for device-side traces; None
        where the host's clock is the truth (CPU)."""
        return None


class DeviceStreams(CommStreams):
    """An accelerator's streams and events (torch's device-module API: ``torch.cuda``
    and alike). Stream priorities follow torch's FSDP2: high for all-gathers, so they
    start as soon as their inputs are ready; default for all-reduces."""

    has_streams = True

    def __init__(self, device: torch.device) -> None:
        self._module = torch.get_device_module(device.type)
        self._device = device
        self._streams = {
            StreamRole.ALL_GATHER: self._module.Stream(device=device, priority=-1),
            StreamRole.ALL_REDUCE: self._module.Stream(device=device),
        }

    def _current(self) -> Any:
        return self._module.current_stream(self._device)

    @contextmanager
    def on(self, role: StreamRole | None) -> Iterator[None]:
        if role is None:
            yield
            return
        with self._module.stream(self._streams[role]):
            yield

    @contextmanager
    def on_user_stream(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        compute = self._current()
        stream.wait_stream(compute)
        with self._module.stream(stream):
            yield
        # What ran there may have changed the tensors compute reads next; and compute
        # frees them later, so the caching allocator reuses their memory only then.
        compute.wait_stream(stream)

    def wait_for_compute(self, role: StreamRole) -> None:
        self._streams[role].wait_stream(self._current())

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        if event is not None:
            stream = self._streams[role] if role is not None else self._current()
            stream.wait_event(event)

    def join(self, role: StreamRole) -> None:
        self._current().wait_stream(self._streams[role])

    def record_compute(self) -> Any:
        return self._current().record_event()

    def record_on(self, role: StreamRole) -> Any:
        return self._streams[role].record_event()

    def wait_on_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def timing_event(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record()  # on the current stream, inside `on` the side stream's
        return event


def streams_for(device: torch.device) -> CommStreams:
    """The backend for FSDP's compute device: streams on an accelerator, none on the
    host (or before a meta-device model is materialized)."""
    if device.type in ("cpu", "meta"):
        return CommStreams()
    return DeviceStreams(device)
