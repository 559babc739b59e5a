"""CollectiveCheck: ranks agree on every FSDP collective before they issue it.

Collectives only work when every rank of the group issues the same one, in the same
order, with the same size. Control flow that diverges between ranks (one rank skips a
``fully_shard`` block, or leaves a parameter unused and so reduce-scatters a smaller
buffer) breaks that: gloo aborts the process (SIGABRT) on a size mismatch, NCCL hangs
or corrupts, and two groups of equal size silently exchange the wrong parameters.

With the divergence check on, every FSDP collective is preceded by a small all-gather
of its signature over the same process group: the per-group sequence number, the
``fully_shard`` module's FQN, the phase, the kind and the byte size (``SIGNATURE_FIELDS``
int64s a rank). Every rank compares all rows; a difference raises
``CollectiveMismatchError`` on every rank, naming what each rank was about to issue,
before the real collective can abort or hang. The check all-gather has the same size
on every rank whatever it describes, so it never aborts itself. A rank that issues no
further FSDP collective at all leaves the others waiting in the check; ``timeout``
bounds that wait (the process group's own timeout otherwise).

Either error is raised on every rank after resetting the root's iteration state, as
``reset_iter_state`` does after any exception: the next forward starts clean.

The non-finite gradient guard rides on the same all-gather before each reduce-scatter:
a rank whose unsharded gradients hold a NaN or Inf sends the index of the first such
parameter, and every rank raises ``NonFiniteGradError`` naming it, before the
reduction spreads it to every rank's shards.

Cost: one synchronous round trip per collective (the host waits for the slowest rank a
little earlier than the collective would have made it wait); measured in
``benchmarks/bench_checks.py``. Both checks are one `CommObserver` (runtime/observer.py)
that the root's setters attach to every group of its tree: with both off, the runtime
calls nothing of this module.
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..runtime.collectives import _all_gather_single
from ..runtime.mesh import backend_for
from ..runtime.observer import Collective, CommObserver

PHASES = ("forward", "backward", "explicit")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# seq, fqn crc32, phase, kind, nbytes, index of the first non-finite grad (-1: none)
SIGNATURE_FIELDS = 6
_NO_NONFINITE = -1


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different FSDP collectives: their control flow
    diverged. Raised on every rank of the group, before the collective."""


class NonFiniteGradError(RuntimeError):
    """A rank's gradients held a NaN or Inf before FSDP reduced them. Raised on every
    rank of the group (``FSDPModule.set_nonfinite_grad_check``)."""


@dataclass(frozen=True)
class CollectiveSignature:
    """What every rank must agree on before one FSDP collective."""

    seq: int  # per process group: the how-manieth FSDP collective on it
    fqn: str  # the fully_shard module's FQN ('' for the root)
    phase: str
    kind: str
    nbytes: int

    def describe(self) -> str:
        return (
            f"{self.kind} #{self.seq} of '{self.fqn or 'root'}' in {self.phase} ({self.nbytes:,} B)"
        )


class CollectiveCheck(CommObserver):
    """Per root: the sequence numbers per process group, and the exchange itself."""

    def __init__(
        self,
        *,
        signatures: bool,
        finite_grads: bool,
        fqns: Callable[[], list[str]],
        on_failure: Callable[[], None],
        timeout: timedelta | None = None,
    ) -> None:
        """
        Args:
            signatures: compare every collective's signature (the divergence check).
            finite_grads: exchange non-finite gradient reports before reduce-scatters.
            fqns: every group's FQN under the root (read when naming what other ranks
                sent: ``set_comm_trace`` renames groups).
            on_failure: called on every rank before it raises (the root's
                ``reset_iter_state``: the iteration is abandoned, ready for the next).
            timeout: how long a rank waits for the others at one check.
        """
        self.signatures = signatures
        self.finite_grads = finite_grads
        self.timeout = timeout
        self._fqns = fqns
        self._on_failure = on_failure
        self._seq: dict[dist.ProcessGroup, int] = {}

    def applies_to(self, kind: str) -> bool:
        return self.signatures or (self.finite_grads and kind == "reduce_scatter")

    def before_issue(self, collective: Collective) -> None:
        """`before` for each collective of the groups this check is attached to."""
        if not self.applies_to(collective.kind):
            return
        grads = collective.grads
        names, first = None, _NO_NONFINITE
        if grads is not None:
            names = grads.names
            if self.finite_grads:
                # As the collective will carry them: a narrowing cast may overflow
                # (fp32 to fp16); a widening one cannot, so no fp32 copies of bf16 grads.
                dtype = grads.reduce_dtype
                first = first_nonfinite(
                    [g.to(dtype) if g.dtype.itemsize > dtype.itemsize else g for g in grads.grads]
                )
        self.before(
            collective.group,
            collective.device,
            collective.fqn,
            collective.phase,
            collective.kind,
            collective.nbytes,
            grad_names=names,
            first_nonfinite=first,
        )

    def before(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        fqn: str,
        phase: str,
        kind: str,
        nbytes: int,
        grad_names: list[str] | None = None,
        first_nonfinite: int = -1,
    ) -> None:
        """Agree with every rank of ``group`` on the collective about to be issued.

        Args:
            group: the collective's process group.
            device: the collective's device; the check runs on the host when the group
                has a backend for CPU tensors, else on this device.
            fqn, phase, kind, nbytes: the collective (see ``CollectiveSignature``).
            grad_names: with the gradient guard, the names of the parameters whose
                gradients the reduce-scatter carries, in the same order on every rank.
            first_nonfinite: the index in ``grad_names`` of this rank's first
                non-finite gradient; -1 if all are finite.

        Raises:
            CollectiveMismatchError: ranks disagree on the collective.
            NonFiniteGradError: some rank reported a non-finite gradient.
        """
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        mine = CollectiveSignature(seq, fqn, phase, kind, nbytes)
        try:
            rows = self._exchange(group, device, mine, first_nonfinite)
        except CollectiveMismatchError:
            self._on_failure()
            raise
        ranks = dist.get_process_group_ranks(group)
        if self.signatures:
            names = {_crc(name): name for name in self._fqns()}
            theirs = [_decode(row, names) for row in rows]
            if any(s != mine for s in theirs):
                self._on_failure()
                raise CollectiveMismatchError(_mismatch_message(ranks, theirs))
        bad = {
            rank: row[5] for rank, row in zip(ranks, rows, strict=True) if row[5] != _NO_NONFINITE
        }
        if bad:
            assert grad_names is not None, "a rank reported non-finite grads for no grads"
            self._on_failure()
            raise NonFiniteGradError(
                _nonfinite_message(fqn, {r: grad_names[i] for r, i in bad.items()})
            )

    def _exchange(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        mine: CollectiveSignature,
        first_nonfinite: int,
    ) -> list[list[int]]:
        row = [mine.seq, _crc(mine.fqn), PHASES.index(mine.phase), KINDS.index(mine.kind)]
        row += [mine.nbytes, first_nonfinite]
        on = torch.device("cpu") if _serves_cpu(group, device) else device
        send = torch.tensor(row, dtype=torch.int64, device=on)  # (SIGNATURE_FIELDS,)
        # Filled with our own row first: a group that does not communicate (torch's
        # fake process group) then reports agreement instead of garbage.
        recv = send.repeat(group.size())  # (W * SIGNATURE_FIELDS,)
        work = _all_gather_single(recv, send, group=group, async_op=True)
        if work is not None:
            if self.timeout is None:
                work.wait()
            else:
                try:
                    work.wait(self.timeout)
                except RuntimeError as error:
                    raise CollectiveMismatchError(
                        f"waited {self.timeout.total_seconds():g} s for the other ranks at "
                        f"FSDP's {mine.describe()}: at least one rank did not reach it. "
                        "Its control flow diverged (it issues no more FSDP collectives, "
                        "or other ones), or it is still busy: raise the timeout with "
                        "set_divergence_check(timeout=...)"
                    ) from error
        return recv.view(-1, SIGNATURE_FIELDS).tolist()


def first_nonfinite(grads: list[torch.Tensor]) -> int:
    """The index of the first gradient holding a NaN or Inf, -1 if none: one fused
    max-abs per gradient (NaN propagates through it; finite values cannot overflow)
    and one host sync for the whole group."""
    max_abs = torch.stack(torch._foreach_norm(grads, float("inf")))  # (len(grads),)
    bad = (~max_abs.isfinite()).nonzero()
    return int(bad[0]) if bad.numel() else _NO_NONFINITE


def _decode(row: list[int], names: dict[int, str]) -> CollectiveSignature:
    seq, crc, phase, kind, nbytes, _ = row
    fqn = names.get(crc, f"<unknown module {crc:#x}>")
    return CollectiveSignature(seq, fqn, PHASES[phase], KINDS[kind], nbytes)


def _crc(fqn: str) -> int:
    return zlib.crc32(fqn.encode())


def _serves_cpu(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the check can run on host tensors: no device sync, no device memory.
    Torch's threaded and fake test groups cannot say; they take any tensor."""
    if device.type == "cpu":
        return True
    return backend_for(group, torch.device("cpu")) is not None


def _mismatch_message(ranks: list[int], signatures: list[CollectiveSignature]) -> str:
    per_rank = "\n".join(
        f"  rank {rank}: {signature.describe()}"
        for rank, signature in zip(ranks, signatures, strict=True)
    )
    return (
        "FSDP ranks diverged: they were about to issue different collectives:\n"
        f"{per_rank}\n{mismatch_hint(signatures)}"
    )


def mismatch_hint(signatures: list[CollectiveSignature]) -> str:
    """The likely cause and fix of ranks issuing ``signatures`` at one collective."""
    same_site = {(s.seq, s.fqn, s.kind) for s in signatures}
    if len(same_site) == 1 and signatures[0].kind == "reduce_scatter":
        return (
            "Some ranks left parameters of this module without a gradient (unused on "
            "those ranks only): call model.set_reduce_scatter_unused_params(True) so "
            "every rank reduces zeros for them, or make every rank use them."
        )
    return (
        "The control flow differs between ranks: every rank must run the same "
        "fully_shard modules in the same order (a module skipped on some ranks only "
        "must still run, e.g. on a dummy input)."
    )


def _nonfinite_message(fqn: str, first_per_rank: dict[int, str]) -> str:
    per_rank = "\n".join(f"  rank {rank}: {name}" for rank, name in first_per_rank.items())
    return (
        f"non-finite gradient (NaN or Inf) in '{fqn or 'root'}' before its reduce-scatter; "
        f"the first such parameter per rank:\n{per_rank}\nNothing was reduced and every "
        "rank raised here, with FSDP's state reset (reset_iter_state) and the gradients it "
        "held for this iteration dropped. Skip the step: optimizer.zero_grad() and go on "
        "with the next batch; or find the source, e.g. with "
        "torch.autograd.set_detect_anomaly(True) on those ranks."
    )
