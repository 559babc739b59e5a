"""What the simulated step records: live bytes (torch's ``MemTracker``, plus where its
peak happened and a per-module timeline) and the collectives at the c10d level.

MemTracker keeps its peak and hooks in private fields and methods (checked on torch
2.13); ``PeakTracker.restart_peak`` and ``FrozenSafeMemTracker`` fail loudly if they
move, rather than report a wrong peak or hook a frozen parameter.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# MemTracker's categories (the values of its private _MemRefType), in report order.
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


@dataclass(frozen=True)
class TimelinePoint:
    """Live bytes when a module entered or left a phase, e.g. ``("layers.3",
    "pre_backward", 123)``; the order is the step's."""

    fqn: str
    event: str
    live_bytes: int


def _cpu_total(snapshot: dict[torch.device, dict[str, int]], key: str = "Total") -> int:
    return sum(snap.get(key, 0) for dev, snap in snapshot.items() if dev.type == "cpu")


class _NoHook:
    """Stands for the gradient hooks of a frozen parameter in MemTracker's table of
    hook handles, which it removes at exit."""

    def remove(self) -> None:
        pass


class FrozenSafeMemTracker(MemTracker):
    """torch's MemTracker, on models with frozen parameters too (fine-tuning, LoRA).

    At a module's first forward MemTracker registers gradient hooks on each of its
    parameters that has none yet (to count its gradient), and torch refuses a hook on
    a tensor that does not require grad. A frozen parameter gets no gradient: it is
    entered in that table with hooks that do nothing, so MemTracker counts its bytes as
    a parameter's and hooks the others as before.
    """

    def __init__(self) -> None:
        # Overriding a method MemTracker no longer has would be silently dead: its own
        # hook would then raise on the first frozen parameter, naming neither.
        if getattr(MemTracker, "_track_module_params_and_buffers", None) is None:
            raise RuntimeError(
                "MemTracker's _track_module_params_and_buffers changed: update FrozenSafeMemTracker"
            )
        super().__init__()

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        handles = getattr(self, "_param_to_grad_hook_handles", None)
        if handles is None:
            raise RuntimeError("MemTracker's grad hook table changed: update FrozenSafeMemTracker")
        for param in module.parameters():
            if not param.requires_grad and handles.get(param) is None:
                handles[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class PeakTracker(FrozenSafeMemTracker):
    """MemTracker that also records where its peak was reached (the innermost module
    running, and forward, backward or optimizer step) and a timeline of live bytes at
    each module's forward and backward boundaries.

    "The innermost module running" is, among the modules ModTracker holds active at the
    peak, the deepest in the module tree, and of equally deep ones the one entered
    (forward or backward) last: the top of the call stack. Modules of one depth are
    active together at a hand-off, e.g. in backward ``layers.0`` has begun while
    ``layers.1`` has not yet finished; the one that has just begun is reported. The
    tie is broken by entry order, never by ModTracker's set of names, whose order
    depends on string hashing (``PYTHONHASHSEED``) and on the set's history.
    """

    def __init__(self, root_name: str) -> None:
        super().__init__()
        self._root_name = root_name  # ModTracker's name of the root, stripped from FQNs
        self.peak_module = ""
        self.peak_phase = ""
        self.timeline: list[TimelinePoint] = []
        # ModTracker's name -> the count of module entries when it was last entered,
        # to break ties of depth.
        self._entered: dict[str, int] = {}
        self._entries = 0

    def restart_peak(self) -> None:
        """Start the peak afresh from the live bytes now (MemTracker has no public reset;
        these are the two fields its ``__enter__`` sets)."""
        if not hasattr(self, "_peak_mem") or not hasattr(self, "_peak_mem_snap"):
            raise RuntimeError("MemTracker's peak fields changed: update PeakTracker")
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        self.peak_module, self.peak_phase = "(step start)", "idle"
        self.timeline.clear()

    def live_bytes(self, category: str = "Total") -> int:
        return _cpu_total(self.get_tracker_snapshot("current"), category)

    def peak_breakdown(self) -> dict[str, int]:
        """The peak's bytes per category (they add up to the peak)."""
        peak = self.get_tracker_snapshot("peak")
        return {category: _cpu_total(peak, category) for category in CATEGORIES}

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The step's peak only. MemTracker's own update also walks every module it has
        seen, at every op, for per-module peaks that the plan never reads: O(ops x
        modules), which grows with depth squared. Measured, CPU seconds per ``plan()``
        of the tiny Llama, W=2 (the same figures): 2 blocks 0.92 -> 0.63, 8 blocks
        5.3 -> 2.5 (time.process_time() around 3 calls, after a warm-up one)."""
        current = getattr(self, "_curr_mem_snap", None)
        if current is None:
            raise RuntimeError("MemTracker's current snapshot changed: update PeakTracker")
        raised = False
        for dev, snap in current.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)
                raised = True
        if raised:
            self.peak_module = self._innermost_module()
            self.peak_phase = (
                "optimizer step"
                if self._in_opt
                else "backward"
                if self._mod_tracker.is_bw
                else "forward"
            )

    def _innermost_module(self) -> str:
        names = [n for n in self._mod_tracker.parents if n != "Global"]
        if not names:
            return "(outside modules)"
        # A name's dots are its depth ("Root.layers.0" is 2: layers, then 0); a name
        # never entered through a hook sorts first among equals.
        return self._fqn(max(names, key=lambda n: (n.count("."), self._entered.get(n, -1))))

    def _fqn(self, name: str) -> str:
        # ModTracker names the root by its class and the rest "Root.layers.0".
        return "" if name == self._root_name else name.removeprefix(self._root_name + ".")

    def _record(self, module: torch.nn.Module, event: str) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if name is not None:
            self.timeline.append(TimelinePoint(self._fqn(name), event, self.live_bytes()))

    def _enter(self, module: torch.nn.Module) -> None:
        # Before MemTracker's hook, which may already update the peak.
        name = self._mod_tracker.get_known_fqn(module)
        if name is not None:
            self._entries += 1
            self._entered[name] = self._entries

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        self._enter(module)
        super()._pre_fw_hook(module, inputs)
        self._record(module, "pre_forward")

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        self._record(module, "post_forward")

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        if module is not None:
            self._enter(module)
        super()._pre_bw_hook(module, args)
        if module is not None:
            self._record(module, "pre_backward")

    def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        if module is not None:
            self._record(module, "post_backward")


# (namespace, op) -> (kind, index of the argument holding the unsharded buffer). c10d
# ops are in place with the output first; functional ones take the input first.
_C10D_OPS: dict[tuple[str, str], tuple[str, int]] = {
    ("c10d", "_allgather_base_"): ("all_gather", 0),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 0),
    ("c10d", "allgather_"): ("all_gather", 0),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_"): ("reduce_scatter", 1),
    ("c10d", "allreduce_"): ("all_reduce", 0),
    ("c10d", "allreduce_coalesced_"): ("all_reduce", 0),
    ("c10d", "alltoall_base_"): ("all_to_all", 1),
    ("c10d", "broadcast_"): ("broadcast", 0),
}


def _functional_kind(name: str) -> str:
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        if name.startswith(kind):
            return kind
    return "other"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


class C10dCounter(TorchDispatchMode):
    """Counts the c10d collectives of the step as ``(kind, unsharded bytes)``, below
    every library (ours' own trace attributes them to groups; this is the check that
    nothing else was sent). Functional collectives reach here as c10d ops too."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # let DTensor desugar: its collectives come back here
        if func.namespace == "c10d":
            kind, index = _C10D_OPS.get((func.namespace, func._opname), ("other", 0))
            self.records.append((kind, _nbytes(args[index])))
        elif func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            # Its c10d kernel runs with this mode off: counted here, once.
            kind = _functional_kind(func._opname)
            gathered = args[1] if kind == "all_gather" else 1  # (input, group_size, name)
            self.records.append((kind, _nbytes(args[0]) * gathered))
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}``."""
        return collective_totals(self.records)


def collective_totals(
    records: list[tuple[str, int]], *, all_to_all_as: str | None = None
) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` of ``(kind, bytes)`` records. With
    ``all_to_all_as="reduce_scatter"`` an all-to-all counts as the reduce-scatter it
    carries on gloo (ours' gloo path), to compare a gloo run with an NCCL plan."""
    out: dict[str, dict[str, int]] = {}
    for kind, size in records:
        if kind == "all_to_all" and all_to_all_as is not None:
            kind = all_to_all_as
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += size
    return out
