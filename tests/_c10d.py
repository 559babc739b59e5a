"""Counting the collectives a step really issues, at the c10d level.

``C10dRecorder`` is a ``TorchDispatchMode`` that sees every collective op that passes
the dispatcher, whoever issues it: ``dtensor_fsdp``, torch's ``fully_shard``, a tensor
subclass (torchao's float8 computes its amax with a functional all-reduce), DTensor
redistributes. It records ``(kind, bytes)`` per op, where bytes is the size of the
unsharded buffer: the output of an all-gather, the input of a reduce-scatter or an
all-to-all, the tensor(s) of an all-reduce or a broadcast; and, alongside, the name of
the process group the op ran on (``by_group``).

Why here and not from our own ``CommTrace``: a comparison with torch's ``fully_shard``
needs the same ruler on both sides, and torch keeps no trace of ours. Counting below
both libraries also catches traffic our trace does not know about (an extension's
own collectives, a collective issued twice) and needs no cooperation from the code
under test, so a test built on it fails if the package sends something else than it
reports.

Collectives that DTensor issues (redistributions, e.g. the all-reduce that torchao's
``precompute_float8_dynamic_scale_for_fsdp`` triggers on a ``Partial``) are counted:
the mode declines DTensor ops so that DTensor desugars them first, as torch's
``CommDebugMode`` does. A collective issued inside another tensor subclass's own
``__torch_dispatch__`` would run with the mode off and be missed.

The namespaces covered: ``c10d`` (the in-place ops behind
``torch.distributed.all_gather_into_tensor`` and friends), ``_c10d_functional``
(``torch.distributed._functional_collectives``) and its older twin
``_c10d_functional_autograd``. A functional op runs its c10d kernel
inside the mode's handler, where the mode is off, so each collective is counted once.
The op table is torch 2.13's (``torch._C._jit_get_all_schemas()``); an op of these
namespaces missing from it is recorded as ``("other", bytes of its first argument)``
so that a new one is seen, not dropped. ``wait_tensor`` is not a collective.
"""

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "other")

# The unsharded buffer's bytes, from an op's (args, kwargs).
_Size = Callable[[tuple, dict], int]


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(item) for item in value)
    return 0


def _arg(index: int) -> _Size:
    return lambda args, kwargs: nbytes(args[index])


def _gathered(args: tuple, kwargs: dict) -> int:
    # _c10d_functional.all_gather_into_tensor*(input(s), group_size, group_name): the
    # output is group_size times the input.
    return nbytes(args[0]) * args[1]


def _out(args: tuple, kwargs: dict) -> int:
    return nbytes(kwargs["out"])


def _functional_ops(namespace: str) -> dict[tuple[str, str], tuple[str, _Size]]:
    """``_c10d_functional`` (or its older autograd-registered twin): inputs first,
    outputs returned (or ``out=``)."""
    return {
        (namespace, "all_gather_into_tensor"): ("all_gather", _gathered),
        (namespace, "all_gather_into_tensor_coalesced"): ("all_gather", _gathered),
        (namespace, "all_gather_into_tensor_out"): ("all_gather", _out),
        (namespace, "reduce_scatter_tensor"): ("reduce_scatter", _arg(0)),
        (namespace, "reduce_scatter_tensor_coalesced"): ("reduce_scatter", _arg(0)),
        (namespace, "reduce_scatter_tensor_out"): ("reduce_scatter", _arg(0)),
        (namespace, "all_to_all_single"): ("all_to_all", _arg(0)),
        (namespace, "all_reduce"): ("all_reduce", _arg(0)),
        (namespace, "all_reduce_"): ("all_reduce", _arg(0)),
        (namespace, "all_reduce_coalesced"): ("all_reduce", _arg(0)),
        (namespace, "all_reduce_coalesced_"): ("all_reduce", _arg(0)),
        (namespace, "broadcast"): ("broadcast", _arg(0)),
        (namespace, "broadcast_"): ("broadcast", _arg(0)),
    }


class C10dRecorder(TorchDispatchMode):
    """Records each collective that passes the dispatcher as ``(kind, unsharded bytes)``
    in ``records``, in issue order."""

    # (namespace, op name) -> (kind, unsharded buffer bytes from (args, kwargs)).
    OPS: ClassVar[dict[tuple[str, str], tuple[str, _Size]]] = {
        # c10d: in-place, output tensors first.
        ("c10d", "_allgather_base_"): ("all_gather", _arg(0)),
        ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", _arg(0)),
        ("c10d", "allgather_"): ("all_gather", _arg(0)),
        ("c10d", "allgather_coalesced_"): ("all_gather", _arg(0)),
        ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", _arg(1)),
        ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", _arg(1)),
        ("c10d", "reduce_scatter_"): ("reduce_scatter", _arg(1)),
        ("c10d", "alltoall_base_"): ("all_to_all", _arg(1)),
        ("c10d", "alltoall_"): ("all_to_all", _arg(1)),
        ("c10d", "allreduce_"): ("all_reduce", _arg(0)),
        ("c10d", "allreduce_coalesced_"): ("all_reduce", _arg(0)),
        ("c10d", "broadcast_"): ("broadcast", _arg(0)),
    }
    OPS.update(_functional_ops("_c10d_functional"))
    OPS.update(_functional_ops("_c10d_functional_autograd"))
    NAMESPACES: ClassVar[frozenset[str]] = frozenset(
        {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
    )
    # Ops of those namespaces that move no data between ranks.
    NOT_COLLECTIVES: ClassVar[frozenset[str]] = frozenset(
        {"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []
        # The name of the process group each record's collective ran on, in the same
        # order (None for an op that names none).
        self.groups: list[str | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            # A mode runs before tensor subclasses, and calls `func` with itself off:
            # DTensor's redistributions (e.g. the all-reduce of a Partial) would run
            # unseen. Declining lets DTensor desugar first; the collectives it issues
            # then come back here (torch's CommDebugMode does the same).
            return NotImplemented
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._opname
        if namespace in self.NAMESPACES and name not in self.NOT_COLLECTIVES:
            kind, size = self.OPS.get((namespace, name), ("other", _arg(0)))
            self.records.append((kind, size(args, kwargs)))
            self.groups.append(_group_name(func, args, kwargs))
        return func(*args, **kwargs)

    def by_group(self) -> dict[str | None, list[str]]:
        """The kinds of the recorded collectives per process group name, in order."""
        out: dict[str | None, list[str]] = {}
        for (kind, _), group in zip(self.records, self.groups, strict=True):
            out.setdefault(group, []).append(kind)
        return out


def _group_name(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The process group an op runs on: ``c10d`` ops take the group (a ScriptObject
    that ``ProcessGroup.unbox`` turns back into one), functional ones its name."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name not in ("process_group", "group_name"):
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if argument.name == "group_name":
            return value
        return dist.ProcessGroup.unbox(value).group_name
    return None


def bytes_of(records: list[tuple[str, int]], kind: str) -> int:
    """Total unsharded bytes of the ``kind`` collectives in ``records``."""
    assert kind in KINDS, kind
    return sum(size for k, size in records if k == kind)


def count_of(records: list[tuple[str, int]], kind: str) -> int:
    """How many ``kind`` collectives ``records`` holds."""
    assert kind in KINDS, kind
    return sum(1 for k, _ in records if k == kind)


class ReduceScatterInputs(TorchDispatchMode):
    """The reduce-scatter inputs alive at each reduce-scatter issued (the one issued
    included): the reductions in flight, as either library sees them, counted by weak
    references to the input storages (each group's gradients copied into one (W, shard)
    buffer, held until the reduction is waited). On gloo ours reduce-scatters with an
    all-to-all."""

    # c10d op -> index of the argument that is the reduce-scatter's input
    OPS: ClassVar[dict[str, int]] = {
        "alltoall_base_": 1,
        "_reduce_scatter_base_": 1,
        "reduce_scatter_tensor_coalesced_": 1,
    }

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[tuple[weakref.ref, int]] = []
        self.alive: list[int] = []  # per issue, the inputs alive
        self.peak_count = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        index = self.OPS.get(func._opname) if func.namespace == "c10d" else None
        if index is not None:
            for tensor in args[index] if isinstance(args[index], list) else [args[index]]:
                storage = tensor.untyped_storage()
                self.inputs.append((weakref.ref(storage), storage.nbytes()))
            live = [nbytes for ref, nbytes in self.inputs if ref() is not None]
            self.alive.append(len(live))
            self.peak_count = max(self.peak_count, len(live))
            self.peak_bytes = max(self.peak_bytes, sum(live))
        return func(*args, **(kwargs or {}))
