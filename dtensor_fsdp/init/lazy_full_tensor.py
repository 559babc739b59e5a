"""Lazy full parameters for ``init_unsharded``: memory-bounded, exact meta-device init.

[Note: lazy full parameters]
Inside ``init_unsharded`` each managed parameter is registered as an
``nn.Parameter(LazyFullTensor)``: a wrapper tensor with the full shape, dtype and device
but no storage. Metadata (``shape``, ``dtype``, ``numel()``...) costs nothing. The first
op on it (``normal_``, ``copy_``, a read such as ``std()``) *materializes* its backing
tensor, a plain full tensor in the original dtype, then runs the op on the backing
tensors in place of the wrappers, so the op consumes the random stream exactly as it
would on the eager model, in the same order. What the op returns:

- an in-place or ``out=`` op on a wrapper returns that wrapper;
- ``detach()`` and ``.data`` return another wrapper of the same parameter, without
  materializing it (``nn.Parameter`` itself calls ``detach()``); ``param.data = x``
  makes ``x`` (same shape, dtype and device) the backing tensor, aliased as on an eager
  model;
- anything else is a plain tensor: results, and views such as ``p[i]``, ``p.view(...)``
  or ``p.t()``, which alias the backing tensor. Init code uses them at once; a view
  kept until after its parameter was evicted (below) writes into a dropped tensor.

`InitCache` (one per ``init_unsharded`` call) holds the materialized parameters in LRU
order and keeps their full bytes within a budget: before materializing one it evicts
the least recently used others until the new one fits. Eviction keeps this rank's chunk
of the backing tensor in the sharded param (as the old eager exit did) and drops the
backing tensor. Touching an evicted parameter again re-materializes it from the sharded
params of every rank (one all-gather over the shard group), so the values written
before survive. A parameter first touched starts uninitialized (``torch.empty``), as
after ``to_empty``: init code that writes only part of it (``p[0].zero_()``) leaves the
rest as an eager model's uninitialized memory would be. Every rank runs the same init
code in the same order and the budget depends only on global shapes, so the ranks evict
and all-gather the same parameters at the same points and the collectives match. On exit every materialized parameter is
written back.

The unit is one parameter, not one group: touching one parameter costs its own bytes
only, and parameters never touched keep their sharded values.
"""

from collections import OrderedDict
from typing import Any, Self

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..runtime.param import FSDPParam
from .full_param import full_for_init, init_device, write_back_from_init


class LazyEntry:
    """One managed parameter inside ``init_unsharded``: its backing tensor, if any."""

    def __init__(self, fsdp_param: FSDPParam, cache: "InitCache", name: str) -> None:
        self.fsdp_param = fsdp_param
        self.cache = cache
        self.name = name  # for messages: the path from init_unsharded's module
        self.nbytes = fsdp_param.shape.numel() * fsdp_param.dtype.itemsize
        self.full: torch.Tensor | None = None  # (*shape): the backing tensor, when live
        self.written_back = False  # the sharded param holds values init code wrote
        self.pins = 0  # > 0 while an op runs on it: not evictable

    def materialize(self) -> torch.Tensor:
        """The backing tensor, materialized (or re-gathered) first if needed."""
        self._check_open()
        return self.cache.acquire(self)

    def assign(self, value: torch.Tensor) -> None:
        """``param.data = value``: ``value`` becomes the backing tensor (aliased, as on
        an eager model); it must have the parameter's shape, dtype and device."""
        self._check_open()
        param = self.fsdp_param
        if isinstance(value, LazyFullTensor):
            value = value._entry.materialize()  # another parameter's: alias its full tensor
        expected = (param.shape, param.dtype, init_device(param))
        if (value.shape, value.dtype, value.device) != expected:
            raise ValueError(
                f"init_unsharded: cannot assign a {value.dtype} tensor of shape "
                f"{tuple(value.shape)} on {value.device} to '{self.name}' ({param.dtype}, "
                f"{tuple(param.shape)}, {init_device(param)}); FSDP keeps the parameter's "
                "shape and dtype: copy the values in place (param.copy_(value)) instead"
            )
        self.cache.admit(self, value.detach())

    def _check_open(self) -> None:
        if self.cache.closed:
            raise RuntimeError(
                f"init_unsharded: parameter '{self.name}' was used after the "
                "init_unsharded context exited; use the module's parameters instead"
            )


class LazyFullTensor(torch.Tensor):
    """A full parameter without storage; see [Note: lazy full parameters]."""

    _entry: LazyEntry
    # Only __torch_dispatch__: ops reach it after autograd, so the in-place checks on
    # leaves that require grad behave as on a plain tensor.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, entry: LazyEntry) -> Self:
        fsdp_param = entry.fsdp_param
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            fsdp_param.shape,
            dtype=fsdp_param.dtype,
            device=init_device(fsdp_param),
            requires_grad=False,
        )
        tensor._entry = entry
        return tensor

    @property
    def data(self) -> "LazyFullTensor":  # type: ignore[override]
        """Another lazy tensor of the same parameter, as ``detach()``."""
        return LazyFullTensor(self._entry)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's setter would swap the wrapper's (empty) storage and lose the value.
        self._entry.assign(value)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LazyFullTensor({self._entry.name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            return LazyFullTensor(args[0]._entry)  # `detach()`: still lazy
        wrappers = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, LazyFullTensor)]
        entries = list({id(t._entry): t._entry for t in wrappers}.values())
        for entry in entries:  # an op on several parameters keeps them all live
            entry.pins += 1
        try:
            by_backing: dict[int, LazyFullTensor] = {}
            for wrapper in wrappers:  # the first (an in-place op's self) wins
                by_backing.setdefault(id(wrapper._entry.materialize()), wrapper)
            args, kwargs = tree_map_only(LazyFullTensor, lambda t: t._entry.full, (args, kwargs))
            out = func(*args, **kwargs)
        finally:
            for entry in entries:
                entry.pins -= 1
        # An in-place or out= op returns its backing tensor: hand back the wrapper.
        return tree_map_only(torch.Tensor, lambda t: by_backing.get(id(t), t), out)


class InitCache:
    """The materialized full parameters of one ``init_unsharded`` call.

    Attributes (read them through the object ``init_unsharded`` yields):
        budget_bytes: the most full bytes kept materialized at once (one op on
            several parameters may exceed it while it runs).
        live_bytes: full bytes materialized now.
        peak_bytes: the most full bytes materialized at once so far.
        all_gathers: re-materializations of evicted parameters (one all-gather each).
        evictions: parameters written back to their shards before the exit.
        eager_bytes: full bytes of the parameters registered eagerly for the whole
            context (tensor-parallel and all-gather-extension parameters).
    """

    def __init__(self, budget_bytes: int, eager_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.eager_bytes = eager_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.all_gathers = 0
        self.evictions = 0
        self.closed = False
        self._live: OrderedDict[int, LazyEntry] = OrderedDict()  # least recent first

    def acquire(self, entry: LazyEntry) -> torch.Tensor:
        """``entry``'s backing tensor, now the most recently used."""
        if entry.full is not None:
            self._live.move_to_end(id(entry))
            return entry.full
        self._evict_until_fits(entry.nbytes)
        if entry.written_back:
            self.all_gathers += 1
        self._add(entry, full_for_init(entry.fsdp_param, gathered=entry.written_back))
        return entry.full

    def admit(self, entry: LazyEntry, full: torch.Tensor) -> None:
        """Make ``full`` (assigned by init code) ``entry``'s backing tensor."""
        if entry.full is not None:
            self._drop(entry)
        self._evict_until_fits(entry.nbytes)
        self._add(entry, full)

    def _add(self, entry: LazyEntry, full: torch.Tensor) -> None:
        entry.full = full
        self._live[id(entry)] = entry
        self.live_bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _drop(self, entry: LazyEntry) -> None:
        entry.full = None
        del self._live[id(entry)]
        self.live_bytes -= entry.nbytes

    def _evict_until_fits(self, nbytes: int) -> None:
        # Least recently used first; parameters an op is running on stay.
        for entry in list(self._live.values()):
            if self.live_bytes + nbytes <= self.budget_bytes:
                return
            if entry.pins == 0:
                self._evict(entry)
                self.evictions += 1

    def _evict(self, entry: LazyEntry) -> None:
        assert entry.full is not None
        write_back_from_init(entry.fsdp_param, entry.full)
        entry.written_back = True
        self._drop(entry)

    def close(self) -> None:
        """Write every materialized parameter back to its shard (local copies, no
        collective: safe on an exception too); later uses raise."""
        self.closed = True
        for entry in list(self._live.values()):
            self._evict(entry)
