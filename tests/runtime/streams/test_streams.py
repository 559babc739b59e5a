"""The stream layer (dtensor_fsdp/runtime/streams.py), driven by the real scheduling code on CPU.

On the host every stream call is a no-op, so the suite as a whole checks that the CPU
backend keeps every behaviour. These tests put instrumented backends in its place
(after lazy init, on the root's ``CommContext``) and check what an accelerator relies
on, with the same scheduling code:

- ``RecordingStreams`` logs every stream call, each collective with the stream it was
  issued on, and each block's compute: FSDP's all-gathers run on the all-gather stream,
  which waits for the compute stream only where data flows, so the next block's
  all-gather is never ordered after this block's compute; copy-out waits for the
  all-gather stream's event; in forward the all-gather stream waits for a copy-out
  only at the next copy-out (torch's overlap), with at most two all-gather outputs
  alive; a user's ``unshard()`` stays on the compute stream; hpZ and HSDP's all-reduce
  wait for exactly their inputs. Training through it matches torch's ``fully_shard``
  bitwise. (test_deferred_streams.py runs the same code where a missing wait gives
  wrong numbers.)
- ``DeferredCopyStreams`` is a device whose asynchronous device-to-host copies land
  only when the host waits for an event recorded after them (CPU offload's race): the
  grads must be right after every backward, micro-batches included.
- ``FakeTimingStreams`` hands out timing events on a fake device clock: the trace's
  exposed time is then the device stall, and the Chrome export has a device track.
- ``DeviceStreams`` itself on a fake ``torch.cuda`` (every call checked against
  torch.cuda's signatures): a traced step, and ``set_all_reduce_hook(stream=)``, whose
  hook runs on the user's stream between the reduction and the grads.
"""

import contextlib
import copy
import gc
import inspect
import json
import math
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import dtensor_fsdp.runtime.param_group as param_group_module
from dtensor_fsdp import CommTrace, CPUOffloadPolicy
from dtensor_fsdp.runtime.collectives import AllGatherResult
from dtensor_fsdp.runtime.reduction.gradient_reduction import GradientReduction
from dtensor_fsdp.runtime.streams import CommStreams, DeviceStreams, StreamRole
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import local_pairs
from tests._pool import GlooPools

WORLD_SIZE = 4


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return F.mse_loss(model(x), y)


def _root_ctx(model: torch.nn.Module) -> Any:
    ctx = model._get_fsdp_state().ctx
    assert ctx is not None, "run a forward first (lazy init)"
    return ctx


# ---------------------------------------------------------------------------
# Instrumented backends
# ---------------------------------------------------------------------------


class RecordingStreams(CommStreams):
    """Host semantics (work runs at once), plus a log of what a device would order."""

    has_streams = True

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.role: StreamRole | None = None
        self._events = 0

    @staticmethod
    def _name(role: StreamRole | None) -> str:
        return role.name if role is not None else "compute"

    @contextmanager
    def on(self, role: StreamRole | None) -> Iterator[None]:
        outer, self.role = self.role, role
        try:
            yield
        finally:
            self.role = outer

    def wait_for_compute(self, role: StreamRole) -> None:
        self.log.append(("wait_for_compute", self._name(role)))

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        if event is not None:
            self.log.append(("wait_for_event", self._name(role), str(event)))

    def join(self, role: StreamRole) -> None:
        self.log.append(("join", self._name(role)))

    def record_compute(self) -> str:
        self._events += 1
        self.log.append(("record_compute", f"event{self._events}"))
        return f"event{self._events}"

    def record_on(self, role: StreamRole) -> str:
        self._events += 1
        self.log.append(("record_on", self._name(role), f"event{self._events}"))
        return f"event{self._events}"


@contextmanager
def _logging_collectives(
    streams: RecordingStreams, alive: list[int] | None = None
) -> Iterator[None]:
    """Log each all-gather with the stream it is issued on; blocks log their compute.
    With ``alive``: after each all-gather, how many all-gather outputs are alive (weak
    references, after a garbage collection)."""
    original = param_group_module.all_gather
    outputs: list[weakref.ref[torch.Tensor]] = []

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        streams.log.append(("all_gather", streams._name(streams.role)))
        result = original(*args, **kwargs)
        if alive is not None:
            result = _held_only_by_fsdp(result)
            outputs.append(weakref.ref(result.output))
            gc.collect()
            alive.append(sum(ref() is not None for ref in outputs))
        return result

    param_group_module.all_gather = all_gather
    try:
        yield
    finally:
        param_group_module.all_gather = original


def _log_compute(model: torch.nn.Sequential, streams: RecordingStreams) -> None:
    # Registered after fully_shard's (prepended) pre-hook: runs once the block is
    # unsharded, right before its compute is queued.
    for index in (0, 2, 4):
        model[index].register_forward_pre_hook(
            lambda _m, _a, index=index: streams.log.append(("compute", str(index)))
        )


class DeferredCopyStreams(CommStreams):
    """A device whose non-blocking device-to-host copies land only when the host waits
    on an event recorded after them, as CUDA's do; until then the host sees NaN."""

    def __init__(self) -> None:
        self.in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.deferred_copies = 0

    def copy_to_host(self, tensor: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
        if not non_blocking:
            return super().copy_to_host(tensor, dtype, non_blocking)
        source = tensor.detach().to(dtype=dtype, copy=True)  # what the device will send
        destination = torch.full_like(source, math.nan)
        self.in_flight.append((destination, source))
        self.deferred_copies += 1
        return destination

    def record_compute(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        event, self.in_flight = self.in_flight, []  # the copies issued so far
        return event

    def wait_on_host(self, event: Any) -> None:
        for destination, source in event or []:
            destination.copy_(source)

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        pass  # streams run in order here: only the host's copies are deferred


class FakeEvent:
    """A timing event on a fake device clock: the host's, when it was recorded."""

    def __init__(self) -> None:
        self.time_s = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.time_s - self.time_s) * 1e3  # milliseconds, as torch's


class FakeTimingStreams(CommStreams):
    def timing_event(self) -> FakeEvent:
        return FakeEvent()


def _bind(function: Any, *args: Any, **kwargs: Any) -> None:
    """Fail unless the call binds to ``function``'s signature (torch.cuda's API)."""
    inspect.signature(function).bind(*args, **kwargs)


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for name, count in other.items():
        into[name] = max(into.get(name, 0), count)


def _covers(clock: dict[str, int], other: dict[str, int]) -> bool:
    """Whether a stream whose clock is ``clock`` has waited for everything ``other`` saw."""
    return all(clock.get(name, 0) >= count for name, count in other.items())


class _FakeCudaStream:
    """A stream with a vector clock (what of each stream it has waited for): enough to
    tell whether torch.cuda's calls order what was asked, with no work to run."""

    def __init__(self, module: "_FakeCudaModule", name: str) -> None:
        self.module, self.name = module, name
        self.clock = {name: 0}

    def tick(self) -> dict[str, int]:
        """A point on this stream (what was issued on it so far); its clock there."""
        self.clock[self.name] += 1
        return dict(self.clock)

    def wait_stream(self, stream: "_FakeCudaStream") -> None:
        _bind(torch.cuda.Stream.wait_stream, self, stream)
        _merge(self.clock, stream.tick())

    def wait_event(self, event: "_FakeCudaEvent") -> None:
        _bind(torch.cuda.Stream.wait_event, self, event)
        _merge(self.clock, event.clock)

    def record_event(self, event: Any = None) -> "_FakeCudaEvent":
        _bind(torch.cuda.Stream.record_event, self, event)
        event = event or _FakeCudaEvent()
        event.clock = self.tick()
        return event


class _FakeCudaEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        _bind(torch.cuda.Event.__new__, _FakeCudaEvent, enable_timing=enable_timing)
        self.clock: dict[str, int] = {}

    def record(self, stream: Any = None) -> None:
        _bind(torch.cuda.Event.record, self, stream)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "_FakeCudaEvent") -> float:
        _bind(torch.cuda.Event.elapsed_time, self, end_event)
        return 0.0


class _FakeCudaModule:
    """torch.cuda's stream API as DeviceStreams calls it: every call is checked against
    torch.cuda's own signature; the streams keep vector clocks; nothing is ordered on
    the host (host semantics)."""

    def __init__(self) -> None:
        self.compute = self.current = _FakeCudaStream(self, "compute")
        self.created = 0
        self.Event = _FakeCudaEvent

    def Stream(self, device: Any = None, priority: int = 0) -> _FakeCudaStream:
        _bind(torch.cuda.Stream.__new__, torch.cuda.Stream, device=device, priority=priority)
        self.created += 1
        return _FakeCudaStream(self, f"side{self.created}")

    def current_stream(self, device: Any = None) -> _FakeCudaStream:
        _bind(torch.cuda.current_stream, device)
        return self.current

    @contextmanager
    def stream(self, stream: _FakeCudaStream) -> Iterator[None]:
        _bind(torch.cuda.stream, stream)
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer


class _CheckedDeviceStreams(DeviceStreams):
    """DeviceStreams whose every ordering request from the scheduling code is checked
    in the fake torch.cuda's clocks once made: the waiting stream has waited for what
    was asked (a side stream for compute, compute for an event or a side stream, a
    user's stream around the code run on it), and for no more (an event wait is not a
    whole-stream wait, which would cost the overlap). ``requests`` counts them by kind;
    ``violations`` lists the ones not honoured."""

    def __init__(self, module: _FakeCudaModule) -> None:
        super().__init__(torch.device("cpu"))
        self.fake = module
        self.requests: dict[str, int] = {}
        self.violations: list[str] = []

    def _check(self, kind: str, ok: bool) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1
        if not ok:
            self.violations.append(kind)

    def _stream(self, role: StreamRole | None) -> _FakeCudaStream:
        return self._streams[role] if role is not None else self.fake.current

    def wait_for_compute(self, role: StreamRole) -> None:
        compute = dict(self.fake.current.clock)
        super().wait_for_compute(role)
        self._check("wait_for_compute", _covers(self._streams[role].clock, compute))

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        stream = self._stream(role)
        expected = dict(stream.clock)
        if event is not None:
            _merge(expected, event.clock)
        super().wait_for_event(role, event)
        self._check("wait_for_event", stream.clock == expected)

    def join(self, role: StreamRole) -> None:
        super().join(role)
        side = self._streams[role]
        self._check("join", _covers(self.fake.current.clock, {side.name: side.clock[side.name]}))

    def record_compute(self) -> Any:
        event = super().record_compute()
        self._check("record_compute", event.clock == self.fake.current.clock)
        return event

    def record_on(self, role: StreamRole) -> Any:
        event = super().record_on(role)
        self._check("record_on", event.clock == self._streams[role].clock)
        return event

    @contextmanager
    def on(self, role: StreamRole | None) -> Iterator[None]:
        stream = self._streams[role] if role is not None else None
        start = stream.clock[stream.name] if stream is not None else 0
        with super().on(role):
            yield
            # What was issued there is a new point on the stream, unless an event
            # recorded there already marks it.
            if stream is not None and stream.clock[stream.name] == start:
                stream.tick()

    @contextmanager
    def on_user_stream(self, stream: Any) -> Iterator[None]:
        compute = self.fake.current
        before = dict(compute.clock)
        with super().on_user_stream(stream):
            waited = stream is None or _covers(stream.clock, before)
            self._check("user_stream_after_compute", waited)
            yield
            done = stream.tick() if stream is not None else {}  # the hook's work on it
        self._check("compute_after_user_stream", _covers(compute.clock, done))


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------


def _schedule(rank: int, mesh: Any) -> dict[str, Any]:
    """One training step recorded; then the same steps on torch's fully_shard."""
    base = mlp()
    ours = shard_mlp(copy.deepcopy(base), mesh)
    theirs = shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    records = []
    streams = RecordingStreams()
    alive: list[int] = []  # all-gather outputs alive after each all-gather
    _log_compute(ours, streams)
    for step in range(2):
        if step == 1:  # after lazy init, which made the host backend
            _root_ctx(ours).streams = streams
            streams.log.clear()  # step 0's compute
        with _logging_collectives(streams, alive) if step == 1 else contextlib.nullcontext():
            losses = [_loss(m, step, rank) for m in (ours, theirs)]
            streams.log.append(("backward",))
            for loss in losses:
                loss.backward()
        records.append({"loss": [loss.item() for loss in losses]})
        records[-1]["grads"] = local_pairs(ours, theirs, grads=True)
        for optim in optims:
            optim.step()
            optim.zero_grad()
        records[-1]["params"] = local_pairs(ours, theirs, grads=False)
    step_log = list(streams.log)
    with _logging_collectives(streams):
        streams.log.clear()
        ours[2].unshard()
        explicit = list(streams.log)
        ours[2].reshard()
    return {
        "log": step_log,
        "explicit": explicit,
        "records": records,
        "alive": alive,
        "alive_after_direct_call": _alive_after_direct_call(ours[2], torch.randn(4, 16)),
    }


def _held_only_by_fsdp(result: AllGatherResult) -> AllGatherResult:
    """``result`` done, its output in a tensor no backend knows: gloo's work may hold
    its own output for a moment after the wait, which a weak-reference count of what
    FSDP keeps alive must not see."""
    if result.work is not None:
        result.work.wait()
    return AllGatherResult(output=result.output.clone(), work=None)


def _alive_after_direct_call(block: torch.nn.Module, x: torch.Tensor) -> int:
    """All-gather outputs alive once a non-root FSDP module's forward, called outside
    the root's forward (a chunked loss's output head, say), has returned."""
    outputs: list[weakref.ref[torch.Tensor]] = []
    original = param_group_module.all_gather

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        result = _held_only_by_fsdp(original(*args, **kwargs))
        outputs.append(weakref.ref(result.output))
        return result

    param_group_module.all_gather = all_gather
    try:
        with torch.no_grad():
            block(x)
    finally:
        param_group_module.all_gather = original
    gc.collect()
    assert outputs, "the block all-gathered nothing"
    return sum(ref() is not None for ref in outputs)


def _hpz(rank: int, mesh: Any) -> list[tuple[str, ...]]:
    """reshard_after_forward=2 on 4 ranks: the backward all-gather reads the buffer
    kept at post-forward."""
    model = shard_mlp(mlp(), mesh, reshard_after_forward=2)
    _loss(model, 0, rank).backward()
    streams = RecordingStreams()
    _root_ctx(model).streams = streams
    with _logging_collectives(streams):
        loss = _loss(model, 1, rank)
        streams.log.append(("backward",))
        loss.backward()
    return streams.log


def _hsdp(rank: int) -> dict[str, Any]:
    """2 replicas x 2 shards: the all-reduce runs on its own stream, fed by the
    reduce-scatter, and lands the same grads as torch's HSDP."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    base = mlp()
    ours = shard_mlp(copy.deepcopy(base), mesh)
    theirs = shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard)
    _loss(ours, 0, rank).backward()
    _loss(theirs, 0, rank).backward()
    for model in (ours, theirs):
        model.zero_grad()
    streams = RecordingStreams()
    _root_ctx(ours).streams = streams
    for model in (ours, theirs):
        _loss(model, 1, rank).backward()
    return {"log": streams.log, "grads": local_pairs(ours, theirs, grads=True)}


def _offload(
    rank: int, mesh: Any, wait_for_copies: bool, pin_memory: bool = True
) -> dict[str, Any]:
    """CPU offload on a device with deferred copies: two micro-batches (the first with
    set_is_last_backward(False)), a step, one more backward; against torch's. Ours
    copies grads asynchronously only with pin_memory, as torch's (which cannot pin
    without an accelerator: pin_memory=False there; ours pins nothing on a CPU mesh)."""
    base = mlp()
    ours = shard_mlp(
        copy.deepcopy(base), mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory)
    )
    theirs = shard_mlp(
        copy.deepcopy(base),
        mesh,
        shard=torch_fully_shard,
        offload_policy=TorchCPUOffloadPolicy(pin_memory=False),
    )
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    _loss(ours, 0, rank).backward()  # lazy init on the host backend
    ours.zero_grad()
    theirs.zero_grad()  # never ran: nothing to drop
    streams = DeferredCopyStreams()
    _root_ctx(ours).streams = streams
    original = GradientReduction.wait_for_offloaded_grads
    if not wait_for_copies:  # the race, for the control: nobody waits for the copies
        GradientReduction.wait_for_offloaded_grads = lambda self, streams: None
    try:
        records = []
        for step, last in ((1, False), (2, True)):  # two micro-batches of one step
            ours.set_is_last_backward(last)
            theirs.set_is_last_backward(last)
            for model in (ours, theirs):
                _loss(model, step, rank).backward()
            records.append(local_pairs(ours, theirs, grads=True))
        for optim in optims:
            optim.step()
            optim.zero_grad()
        for model in (ours, theirs):
            _loss(model, 3, rank).backward()
        records.append(local_pairs(ours, theirs, grads=True))
        records.append(local_pairs(ours, theirs, grads=False))
    finally:
        GradientReduction.wait_for_offloaded_grads = original
    return {"records": records, "deferred_copies": streams.deferred_copies}


def _fake_cuda_streams() -> tuple[_FakeCudaModule, _CheckedDeviceStreams]:
    """DeviceStreams built on a fake torch.cuda, checking each request it gets."""
    module = _FakeCudaModule()
    original = torch.get_device_module
    torch.get_device_module = lambda device=None: module  # type: ignore[assignment]
    try:
        return module, _CheckedDeviceStreams(module)
    finally:
        torch.get_device_module = original


def _device_streams(rank: int, mesh: Any) -> dict[str, Any]:
    """DeviceStreams itself, on a fake torch.cuda: a traced step calls only torch.cuda's
    API, as torch.cuda spells it, and trains as torch's fully_shard does."""
    module, streams = _fake_cuda_streams()
    base = mlp()
    ours = shard_mlp(copy.deepcopy(base), mesh)
    theirs = shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard)
    _loss(ours, 0, rank).backward()
    _loss(theirs, 0, rank).backward()
    _root_ctx(ours).streams = streams
    ours.set_comm_trace(CommTrace())
    for model in (ours, theirs):
        model.zero_grad()
        _loss(model, 1, rank).backward()
    compute = module.compute.clock
    return {
        "requests": streams.requests,
        "violations": streams.violations,
        # Side streams whose last work compute has not waited for by the step's end.
        "unwaited": sorted(
            s.name for s in streams._streams.values() if compute.get(s.name, 0) < s.clock[s.name]
        ),
        "created": module.created,
        "grads": local_pairs(ours, theirs, grads=True),
    }


def _hook_stream(rank: int, mesh: Any) -> dict[str, Any]:
    """set_all_reduce_hook(hook, stream=) through DeviceStreams on a fake torch.cuda: the
    hook runs on that stream, after the reduction and before the grads land; the same
    hook on torch's fully_shard (a CPU stream) gives the same grads."""
    module, streams = _fake_cuda_streams()
    user = _FakeCudaStream(module, "user")
    base = mlp()
    models = {
        "ours": shard_mlp(copy.deepcopy(base), mesh),
        "torch": shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard),
    }
    hook_ran_on: list[str] = []

    def hook(reduced: torch.Tensor) -> None:
        hook_ran_on.append(module.current.name)
        reduced.mul_(3)

    for model in models.values():
        _loss(model, 0, rank).backward()
        model.zero_grad()
        for group in (model, model[0], model[2]):
            group.set_all_reduce_hook(
                hook, stream=user if model is models["ours"] else torch.cpu.Stream()
            )
    _root_ctx(models["ours"]).streams = streams
    _loss(models["ours"], 1, rank).backward()
    ours_ran_on = list(hook_ran_on)
    _loss(models["torch"], 1, rank).backward()
    return {
        "requests": streams.requests,
        "violations": streams.violations,
        "ran_on": ours_ran_on,
        "grads": local_pairs(models["ours"], models["torch"], grads=True),
    }


def _timing(rank: int, mesh: Any, tmp_dir: str) -> dict[str, Any]:
    model = shard_mlp(mlp(), mesh)
    _loss(model, 0, rank).backward()
    trace = CommTrace()
    model.set_comm_trace(trace)
    _loss(model, 1, rank).backward()  # the host backend: no device timing
    host_only = all(e.device is None for e in trace.events)
    trace.clear()
    _root_ctx(model).streams = FakeTimingStreams()
    _loss(model, 2, rank).backward()
    path = Path(tmp_dir) / f"trace{rank}.json"
    trace.export_chrome_trace(str(path))
    return {
        "host_only": host_only,
        "events": [
            (
                e.kind,
                e.device is not None,
                e.exposed_s,
                e.device.waited.elapsed_time(e.device.done) / 1e3 if e.device else None,
                e.device.issued.time_s <= e.device.waited.time_s if e.device else None,
            )
            for e in trace.events
        ],
        "chrome": [(r["pid"], r["name"]) for r in json.loads(path.read_text())["traceEvents"]],
    }


def _run(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    # Two independent 2-rank FSDP meshes where results are compared with torch's:
    # 2-addend sums are exact in any order, so ours and torch's agree bitwise.
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "fsdp"))["fsdp"]
    return run_scenarios(
        {
            "schedule": lambda: _schedule(rank, pairs),
            "hpz": lambda: _hpz(rank, mesh),
            "hsdp": lambda: _hsdp(rank),
            "offload": lambda: _offload(rank, pairs, wait_for_copies=True),
            "offload_race": lambda: _offload(rank, pairs, wait_for_copies=False),
            "offload_unpinned": lambda: _offload(
                rank, pairs, wait_for_copies=False, pin_memory=False
            ),
            "timing": lambda: _timing(rank, pairs, tmp_dir),
            "device_streams": lambda: _device_streams(rank, pairs),
            "hook_stream": lambda: _hook_stream(rank, pairs),
        }
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list[dict[str, Any]]:
    tmp_dir = str(tmp_path_factory.mktemp("stream_traces"))
    return run_distributed(_run, WORLD_SIZE, tmp_dir, timeout=240, pool=gloo_pool)


def _assert_equal_pairs(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    # Sums of 2 fp32 addends (exact in any order), then a division by 2 (exact): bitwise.
    for name, (ours, theirs) in pairs.items():
        assert torch.equal(ours, theirs), f"{what} {name}: {(ours - theirs).abs().max()}"


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def _gathers(log: list[tuple[str, ...]]) -> list[int]:
    return [i for i, entry in enumerate(log) if entry[0] == "all_gather"]


def test_all_gathers_run_on_their_stream_and_copy_out_waits_for_their_event(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "schedule")):
        log = rec["log"]
        gathers = _gathers(log)
        # Root, block 0, block 2 in forward; blocks 2 and 0 again in backward (the root
        # stays unsharded between forward and backward).
        assert len(gathers) == 5, log
        assert all(log[i] == ("all_gather", "ALL_GATHER") for i in gathers), log
        # The root's pre-forward orders the all-gathers after the optimizer step.
        assert log[0] == ("wait_for_compute", "ALL_GATHER"), log
        for gather in gathers:
            # An event on the all-gather stream right after the all-gather, which the
            # compute stream waits for before the copy-out (whatever Work exists).
            kind, stream, event = log[gather + 1]
            assert (kind, stream) == ("record_on", "ALL_GATHER"), (rank, log)
            assert ("wait_for_event", "compute", event) in log[gather + 2 :], (rank, log)
        # A user's unshard() runs on the compute stream, as torch's does.
        assert rec["explicit"][0] == ("all_gather", "compute"), rec["explicit"]


def test_forward_all_gather_overlaps_the_previous_copy_out_and_compute(run) -> None:
    """torch's forward overlap (``FSDPParamGroup.wait_for_unshard`` with
    ``comm_ctx.all_gather_state``): in forward, after copy-out i, torch records an event
    and keeps all-gather i's result; group i+1's all-gather is issued with no wait on
    that event, and group i+1's ``wait_for_unshard`` makes the all-gather streams wait
    for it and only then frees result i. torch on CPU has no streams to observe, so
    the property is checked on ours: the all-gather stream never waits for the latest
    copy-out (nor for compute) before the next forward all-gather is issued; it waits
    for it before the next copy-out completes; at most two all-gather outputs are
    alive, and two are (the cost torch pays). In backward, as torch's, each copy-out
    is waited right away."""
    for rank, rec in enumerate(scenario_records(run, "schedule")):
        log = rec["log"]
        gathers = _gathers(log)
        backward = log.index(("backward",))
        copy_outs = [i for i, e in enumerate(log) if e[0] == "record_compute"]
        for gather in gathers[1:3]:  # forward, after the root's
            latest = max(i for i in copy_outs if i < gather)  # the previous group's
            event = log[latest][1]
            between = log[latest:gather]
            assert ("wait_for_event", "ALL_GATHER", event) not in between, (rank, log)
            assert ("wait_for_compute", "ALL_GATHER") not in between, (rank, log)
            next_copy_out = min(i for i in copy_outs if i > gather)
            assert ("wait_for_event", "ALL_GATHER", event) in log[gather:next_copy_out], log
        # The last forward copy-out is released by the end of forward.
        for index in (i for i in copy_outs if i < backward):
            waited = ("wait_for_event", "ALL_GATHER", log[index][1])
            assert waited in log[index:backward], (rank, log)
        for index in (i for i in copy_outs if i > backward):
            assert log[index + 1] == ("wait_for_event", "ALL_GATHER", log[index][1]), log
        forward_alive, backward_alive = rec["alive"][:3], rec["alive"][3:]
        assert max(forward_alive) == 2, rec["alive"]  # one kept while the next gathers
        assert backward_alive == [1, 1], rec["alive"]
        # torch releases the kept result at the post-forward of the iteration's first
        # forward (`FSDPState._post_forward`, `iter_forward_root`): a module run on its
        # own keeps nothing past its forward.
        assert rec["alive_after_direct_call"] == 0, rec["alive_after_direct_call"]


def test_training_through_the_streams_matches_torch(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "schedule")):
        for step, record in enumerate(rec["records"]):
            assert record["loss"][0] == record["loss"][1], f"rank {rank} step {step}"
            _assert_equal_pairs(record["grads"], f"rank {rank} step {step} grad")
            _assert_equal_pairs(record["params"], f"rank {rank} step {step} param")


def test_hpz_backward_all_gather_waits_for_the_post_forward_buffer(run) -> None:
    for log in scenario_records(run, "hpz"):
        backward = log.index(("backward",))
        # Compute events of forward: the copy-outs' (the all-gather stream waits for
        # each within forward) and the post-forward buffers'.
        recorded = [e[1] for e in log[:backward] if e[0] == "record_compute"]
        waited_in_forward = {
            e[2] for e in log[:backward] if e[:2] == ("wait_for_event", "ALL_GATHER")
        }
        post_forward = [event for event in recorded if event not in waited_in_forward]
        # The root and blocks 0, 2 keep 1/2 of their params. Recorded in forward,
        # waited in backward: not right away, which would order the next block's
        # forward all-gather after this block's compute.
        assert len(post_forward) == 3, log
        for event in post_forward:
            waited = log.index(("wait_for_event", "ALL_GATHER", event))
            gathers = [i for i in range(waited, len(log)) if log[i][0] == "all_gather"]
            assert backward < waited < gathers[0], log


def test_hsdp_all_reduce_waits_for_its_reduce_scatter_not_for_compute(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "hsdp")):
        log = rec["log"]
        # Per group: the all-reduce stream waits for an event compute recorded when the
        # reduce-scatter was issued (its input, and at shard size 1 its output, were
        # written before), not for all compute queued since; one join after its
        # all-reduce was issued (compute may then free what it read); one
        # wait_for_compute per landing (the all-reduce stream may reuse its buffers once
        # compute read them), never before the all-reduce is issued.
        inputs = [i for i, e in enumerate(log) if e[:2] == ("wait_for_event", "ALL_REDUCE")]
        joins = [i for i, e in enumerate(log) if e == ("join", "ALL_REDUCE")]
        landings = [i for i, e in enumerate(log) if e == ("wait_for_compute", "ALL_REDUCE")]
        assert len(inputs) == len(joins) == len(landings) == 3, log
        for wait, join, landing in zip(inputs, joins, landings, strict=True):
            assert log.index(("record_compute", log[wait][2])) < wait < join < landing, log
        _assert_equal_pairs(rec["grads"], f"rank {rank} HSDP grad")


def test_cpu_offload_grads_land_before_the_host_reads_them(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "offload")):
        # Only the first landing of each grad per step is asynchronous (6 params: 2
        # steps); adding into an existing grad copies synchronously.
        assert rec["deferred_copies"] == 12, rec["deferred_copies"]
        for index, pairs in enumerate(rec["records"]):
            _assert_equal_pairs(pairs, f"rank {rank} record {index}")


def test_cpu_offload_unpinned_copies_grads_synchronously(run) -> None:
    # pin_memory=False: no asynchronous copy (it would land in pinned memory), as
    # torch's; so nothing is left for the (here removed) wait, and the grads are right.
    for rank, rec in enumerate(scenario_records(run, "offload_unpinned")):
        assert rec["deferred_copies"] == 0, rec["deferred_copies"]
        for index, pairs in enumerate(rec["records"]):
            _assert_equal_pairs(pairs, f"rank {rank} record {index}")


def test_offload_race_is_visible_without_the_wait(run) -> None:
    # The control: with nobody waiting for the copies, the host reads unfinished ones.
    for rec in scenario_records(run, "offload_race"):
        first_backward = rec["records"][0]
        assert any(ours.isnan().any() for ours, _ in first_backward.values())


def test_trace_reports_device_stalls_with_timing_events(run) -> None:
    for rec in scenario_records(run, "timing"):
        assert rec["host_only"]
        events = rec["events"]
        kinds = sorted(kind for kind, *_ in events)
        assert kinds == ["all_gather"] * 5 + ["reduce_scatter"] * 3, kinds
        for kind, has_device, exposed, device_exposed, ordered in events:
            assert has_device and ordered, (kind, has_device, ordered)
            assert exposed == max(0.0, device_exposed), kind
        chrome = rec["chrome"]
        assert sorted(n for pid, n in chrome if pid == 0) == sorted(
            n for pid, n in chrome if pid == 1
        )
        assert len(chrome) == 2 * len(events)


def test_device_streams_call_torch_cudas_api(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "device_streams")):
        assert rec["created"] == 2  # the all-gather and all-reduce streams
        # Every call bound to torch.cuda's signature (or the step would have raised);
        # every ordering the scheduling code asked for (the all-gather stream after
        # compute, compute after each copy-out's event, the all-gather stream after the
        # copy-out's release) is one torch.cuda's calls establish, and no more; compute
        # has waited for all the side streams' work by the step's end; the
        # deferred-stream backend checks that those requests leave no hazard
        # (test_deferred_streams.py).
        assert rec["violations"] == [], rec
        assert {"wait_for_compute", "wait_for_event", "record_on"} <= set(rec["requests"]), rec
        assert rec["unwaited"] == [], rec
        _assert_equal_pairs(rec["grads"], f"rank {rank} grad")


def test_all_reduce_hook_runs_on_its_stream_between_the_reduction_and_the_grads(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "hook_stream")):
        # Per group (3): the user's stream waits for compute (the reduced gradients)
        # before the hook runs there, and compute waits for it before the grads land.
        assert rec["violations"] == [], rec
        assert rec["requests"]["user_stream_after_compute"] == 3, rec["requests"]
        assert rec["requests"]["compute_after_user_stream"] == 3, rec["requests"]
        assert rec["ran_on"] == ["user"] * 3
        _assert_equal_pairs(rec["grads"], f"rank {rank} grad")
