"""Live tensor bytes on the CPU, as ``torch.distributed._tools.mem_tracker.MemTracker``
counts them (a ``TorchDispatchMode`` that follows every storage created under it through
a weakref, and storage resizes): the peak of one step, and that peak without the
all-to-all receive buffers ours reduce-scatters through on gloo.

RSS is not used: it does not shrink when tensors are freed and it counts the
interpreter (host RSS around a call: ``rss.py``).
"""

import weakref

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


def reset_peak(tracker: MemTracker) -> None:
    """Start MemTracker's peak afresh from the current live memory.

    MemTracker has no public reset; these are the two fields its ``__enter__`` sets
    (checked on torch 2.13). Without them the peak would also cover the model build
    and step 1.
    """
    if not hasattr(tracker, "_peak_mem") or not hasattr(tracker, "_peak_mem_snap"):
        raise RuntimeError("MemTracker's peak fields changed: update reset_peak()")
    tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}


def restart_step(tracker: MemTracker) -> None:
    """Before another step under the same tracker: its module stats cleared (MemTracker
    refuses a second iteration otherwise) and its peak restarted (``reset_peak``)."""
    tracker.reset_mod_stats()
    reset_peak(tracker)


def total_bytes(snapshot: dict[torch.device, dict[str, int]]) -> int:
    """The CPU's live bytes in a MemTracker snapshot ("current" or "peak")."""
    return sum(snap["Total"] for dev, snap in snapshot.items() if dev.type == "cpu")


class ReceiveBuffers(TorchDispatchMode):
    """Entered inside a MemTracker: its live bytes after every op, and when each
    all-to-all receive buffer lived, for the peak without those buffers."""

    def __init__(self, tracker: MemTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.totals: list[int] = []  # live bytes after op i
        self._created: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> op index
        self._buffers: list[list[int | None]] = []  # [first op live, first op freed, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # as MemTracker: DTensor desugars to local ops first
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname == "alltoall_base_":
            storage = args[0].untyped_storage()  # the output: this rank's receive buffer
            entry = [self._created.get(storage, len(self.totals)), None, storage.nbytes()]
            self._buffers.append(entry)
            weakref.finalize(storage, self._freed, entry)
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() not in self._created:
                self._created[tensor.untyped_storage()] = len(self.totals)
        self.totals.append(total_bytes(self.tracker.get_tracker_snapshot("current")))
        return out

    def _freed(self, entry: list[int | None]) -> None:
        entry[1] = len(self.totals)

    def peak_without_buffers(self) -> int:
        return max(
            (
                total
                - sum(
                    nbytes
                    for first, freed, nbytes in self._buffers
                    if first <= op and (freed is None or op < freed)
                )
                for op, total in enumerate(self.totals)
            ),
            default=0,
        )
