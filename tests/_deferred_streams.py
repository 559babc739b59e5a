"""DeferredStreams: a CPU stand-in for a device whose side streams run out of step
with compute, so that a missing stream wait shows up as wrong numbers.

On the host backend every stream call is a no-op and every op runs at once, so FSDP's
stream ordering is never exercised. ``DeferredStreams`` runs the same scheduling code
(install it on the root's ``CommContext`` after lazy init) under one
``TorchDispatchMode`` (``with streams.running():``) that sees every op and knows, from
``CommStreams.on(role)``, which stream issued it. It models the three hazards FSDP's
stream waits exist for:

1. **Side-stream writes read by compute** (copy-out reads the all-gather's output; the
   all-reduce's result lands). Every op issued inside ``on(role)`` (collectives
   included) runs at once, but what it writes is stashed and the memory is poisoned
   (NaN; 0xFF bytes for integer buffers, which read as NaN through any float view)
   until the compute stream waits for it: ``wait_for_event(None, event)`` with an
   event from ``record_on(role)`` recorded after the op, or ``join(role)``. Later ops
   on the same side stream see its own writes (they are unpoisoned around each of its
   ops); other streams see poison. A wait by another stream (``wait_for_event(other,
   ...)``, ``wait_for_compute``) releases nothing.
2. **Compute writes read by a side stream** (the all-gather reads the optimizer's
   writes, hpZ's post-forward buffer; the all-reduce reads the reduce-scatter input).
   Compute ops are numbered; a side stream has seen compute up to the op it last
   waited for (``wait_for_compute(role)``, or ``wait_for_event(role, event)`` with an
   event from ``record_compute``). A side op reading a storage compute wrote later
   could have read the old bytes on a device: its writes stay poisoned for good.
3. **Side-stream memory freed while compute may still read it** (the all-gather
   output after the copy-out; the caching allocator hands a freed block to the next
   allocation on the stream that allocated it). When a tensor a side op allocated is
   garbage-collected, the stream must have waited for compute's last read of it; if
   not, a hazard is recorded in ``hazards`` (no memory is reused on the host, so this
   one is reported, not poisoned).

Scope: storages are tracked by address, plain tensors and DTensor local tensors only.
Collectives issued on a side stream are completed at issue and their writes released
like the stream's other writes, by an event recorded after them or a join: the model
of a collective running on its issuing stream (NCCL with ``async_op=False``, a custom
all-gather that returns no ``Work``). An asynchronous collective's own ``Work`` is
ordered by the host semantics (gloo's ``work.wait()``), not here. Compute reading
memory that a side stream will overwrite is not modelled (no reuse on the host).
"""

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from dtensor_fsdp.runtime.streams import CommStreams, StreamRole


@dataclass
class _Write:
    """One side-stream write not yet released to compute."""

    seq: int  # the stream's op number
    # An alias of the written memory: the op's own output or view may be a temporary
    # (a column view of a buffer), and its Python object is watched for frees.
    tensor: torch.Tensor
    value: torch.Tensor  # what the op wrote (poison after a stale read)


def _plain(value: Any) -> torch.Tensor | None:
    """The tracked tensor behind ``value``: itself, a DTensor's local tensor, or None."""
    if isinstance(value, DTensor):
        value = value._local_tensor
    if not isinstance(value, torch.Tensor) or type(value) not in (
        torch.Tensor,
        torch.nn.Parameter,
    ):
        return None
    if value.device.type == "meta" or value.untyped_storage().nbytes() == 0:
        return None
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in map(_plain, tree_leaves(value)) if t is not None]


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(math.nan)
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(255 if tensor.dtype == torch.uint8 else -1)


def _written(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[list, list]:
    """(tensors the op mutated, tensors it created). c10d ops write their first
    argument (the output, or the tensors an all-reduce reduces in place)."""
    if func.namespace == "c10d":
        return _tensors(args[0]), []
    mutated = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            mutated += _tensors(value)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    created = [
        t
        for ret, value in zip(func._schema.returns, outs, strict=False)
        if ret.alias_info is None
        for t in _tensors(value)
    ]
    return mutated, created


class _Mode(TorchDispatchMode):
    def __init__(self, streams: "DeferredStreams") -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.streams.role is None:
            return self.streams._run_on_compute(func, args, kwargs)
        return self.streams._run_on_side(self.streams.role, func, args, kwargs)


class DeferredStreams(CommStreams):
    """See the module docstring."""

    has_streams = True

    def __init__(self, dropped: frozenset[tuple[str, str]] = frozenset()) -> None:
        """Args:
        dropped: (waiting stream, event's stream) pairs, by role name or "compute",
            whose ``wait_for_event`` calls are ignored, and (role name, "all compute")
            for ``wait_for_compute``: a control that removes a wait.
        """
        self.dropped = dropped
        self.role: StreamRole | None = None
        self.hazards: list[str] = []
        self.stale_reads = 0  # side ops that read compute writes they did not wait for
        self.deferred_writes = 0  # side-stream writes poisoned until released
        self._clock = 0  # compute ops so far
        self._seq = dict.fromkeys(StreamRole, 0)  # ops issued per side stream
        self._seen = dict.fromkeys(StreamRole, 0)  # compute ops each side stream waited for
        self._pending: dict[StreamRole, list[_Write]] = {role: [] for role in StreamRole}
        self._compute_writes: dict[int, int] = {}  # address -> compute op of last write
        self._compute_reads: dict[int, int] = {}  # side-allocated address -> last read
        self._side_allocated: dict[int, StreamRole] = {}

    @contextmanager
    def running(self) -> Iterator["DeferredStreams"]:
        """Track every op in the enclosed code (one training step, say)."""
        with _Mode(self):
            yield self

    # CommStreams #

    @contextmanager
    def on(self, role: StreamRole | None) -> Iterator[None]:
        outer, self.role = self.role, role
        try:
            yield
        finally:
            self.role = outer

    def wait_for_compute(self, role: StreamRole) -> None:
        if (role.name, "all compute") not in self.dropped:
            self._seen[role] = self._clock

    def wait_for_event(self, role: StreamRole | None, event: Any) -> None:
        if event is None:
            return
        stream, mark = event
        if (_name(role), _name(stream)) in self.dropped:
            return
        if role is None and stream is not None:
            self._release(stream, mark)
        elif role is not None and stream is None:
            self._seen[role] = max(self._seen[role], mark)

    def join(self, role: StreamRole) -> None:
        self._release(role, self._seq[role])

    def record_compute(self) -> tuple[None, int]:
        return (None, self._clock)

    def record_on(self, role: StreamRole) -> tuple[StreamRole, int]:
        return (role, self._seq[role])

    # The model #

    def _release(self, role: StreamRole, upto: int) -> None:
        """Compute now sees ``role``'s writes up to its op ``upto``."""
        keep = []
        with _disable_current_modes(), torch.no_grad():
            for write in self._pending[role]:
                if write.seq <= upto:
                    _assign(write.tensor, write.value)
                else:
                    keep.append(write)
        self._pending[role] = keep

    def _show(self, role: StreamRole, visible: bool) -> None:
        """Unpoison (or poison again) ``role``'s pending writes, in issue order."""
        with _disable_current_modes(), torch.no_grad():
            for write in self._pending[role]:
                if visible:
                    _assign(write.tensor, write.value)
                else:
                    with _preserved_version(write.tensor):
                        _poison(write.tensor)

    def _run_on_compute(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        self._clock += 1
        for tensor in _tensors((args, kwargs)):
            address = _address(tensor)
            if address in self._side_allocated:
                self._compute_reads[address] = self._clock
        mutated, created = _written(func, args, kwargs, out)
        for tensor in mutated + created:
            self._compute_writes[_address(tensor)] = self._clock
        return out

    def _run_on_side(self, role: StreamRole, func: Any, args: tuple, kwargs: dict) -> Any:
        stale = any(
            self._compute_writes.get(_address(t), -1) > self._seen[role]
            for t in _tensors((args, kwargs))
        )
        self.stale_reads += stale
        self._show(role, True)
        out = func(*args, **kwargs)
        if func.namespace == "c10d":
            work = out[-1] if isinstance(out, (tuple, list)) else out
            work.wait()  # completes at issue: see the module docstring
        self._seq[role] += 1
        mutated, created = _written(func, args, kwargs, out)
        with _disable_current_modes(), torch.no_grad():
            for tensor in mutated + created:
                value = tensor.detach().clone()
                if stale:
                    _poison(value)
                self._pending[role].append(_Write(self._seq[role], tensor.detach(), value))
                self._compute_writes.pop(_address(tensor), None)
                self.deferred_writes += 1
        for tensor in created:
            address = _address(tensor)
            self._side_allocated[address] = role
            weakref.finalize(tensor, self._freed, address, role, self._seq[role])
        self._show(role, False)
        return out

    def _freed(self, address: int, role: StreamRole, seq: int) -> None:
        self._side_allocated.pop(address, None)
        last_read = self._compute_reads.pop(address, None)
        if last_read is not None and last_read > self._seen[role]:
            self.hazards.append(
                f"{role.name} op {seq}'s output freed after compute op {last_read} read it, "
                f"but the {role.name} stream waited only for compute op {self._seen[role]}"
            )


def _name(role: StreamRole | None) -> str:
    return role.name if role is not None else "compute"


def _assign(tensor: torch.Tensor, value: torch.Tensor) -> None:
    with _preserved_version(tensor):
        tensor.copy_(value)


@contextmanager
def _preserved_version(tensor: torch.Tensor) -> Iterator[None]:
    """Poisoning and releasing are the model's, not writes autograd should see."""
    if tensor.is_inference():
        yield
        return
    with torch.autograd._unsafe_preserve_version_counter(tensor):
        yield
