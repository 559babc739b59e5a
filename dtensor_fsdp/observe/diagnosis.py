"""What the flight records of every rank say about a stuck or failed FSDP collective.

Pure functions over the records the ranks published (observe/watchdog.py gathers them
through the c10d store): every rank runs the same diagnosis on the same records, so
every rank reaches the same verdict and raises (or warns) with the same message.

- **diverged**: two ranks' records differ at the same collective (same process group,
  same sequence number: another module, phase, kind or size), or every rank waits in a
  different collective. The ranks outside the majority diverged (on a tie, those that
  differ from the lowest rank).
- **stopped**: a rank published nothing within the answer timeout: the backend killed
  it (gloo aborts a rank on mismatched sizes) or it is frozen. The others say what they
  were issuing.
- **straggler**: the records agree and some ranks are merely behind (not waiting in
  FSDP): a warning, not an error.
- **stuck**: every rank waits for the same collective: the backend or the network.
"""

from dataclasses import dataclass
from typing import Any

from .consistency import CollectiveSignature, mismatch_hint

# A record's entry as published: group, seq, fqn, phase, kind, nbytes, step, state, age.
_BEFORE = 2  # collectives shown before the current one of a rank that answered
_FIELDS = ("group", "seq", "fqn", "phase", "kind", "nbytes", "step", "state", "age_s")


@dataclass(frozen=True)
class Entry:
    """One FSDP collective in one rank's flight record."""

    group: str  # the process group's name (the same on every rank)
    seq: int  # the how-manieth FSDP collective on that group
    fqn: str
    phase: str
    kind: str
    nbytes: int
    step: int  # the how-manieth forward after a backward
    state: str  # "issued", "waiting", "done" or "failed"
    age_s: float  # seconds since it was issued, when the record was published

    @staticmethod
    def from_row(row: list[Any]) -> "Entry":
        return Entry(**dict(zip(_FIELDS, row, strict=True)))

    def signature(self) -> CollectiveSignature:
        return CollectiveSignature(self.seq, self.fqn, self.phase, self.kind, self.nbytes)

    def describe(self) -> str:
        when = {"waiting": "waiting for", "failed": "failed after", "issued": "issued"}
        age = f", {when.get(self.state, self.state)} {self.age_s:.1f} s"
        if self.state == "done":
            age = f", done (issued {self.age_s:.1f} s ago)"
        return f"{self.signature().describe()} at step {self.step}{age}"


@dataclass(frozen=True)
class RankRecord:
    """What one rank published: its last collectives, oldest first."""

    rank: int
    entries: list[Entry]
    error: str | None  # the backend error its wait raised, if any

    @staticmethod
    def from_json(value: dict[str, Any]) -> "RankRecord":
        entries = [Entry.from_row(row) for row in value["entries"]]
        return RankRecord(value["rank"], entries, value["error"])

    def current(self) -> Entry | None:
        """The collective this rank's host is blocked on (or whose wait failed)."""
        return next((e for e in reversed(self.entries) if e.state in ("waiting", "failed")), None)

    def describe(self) -> str:
        entry = self.current() or (self.entries[-1] if self.entries else None)
        if entry is None:
            return "no FSDP collective yet"
        text = entry.describe()
        if entry.state not in ("waiting", "failed"):
            text += "; not waiting in FSDP (busy, or blocked outside FSDP)"
        if self.error is not None:
            text += f"; the backend raised: {self.error}"
        return text


@dataclass(frozen=True)
class Verdict:
    kind: str  # "diverged", "stopped", "straggler", "stuck"
    message: str

    @property
    def is_error(self) -> bool:
        return self.kind in ("diverged", "stopped")


def diagnose(records: dict[int, RankRecord], world_size: int, answer_timeout_s: float) -> Verdict:
    """The verdict on the records of every rank that answered (``records``, by rank)."""
    missing = [rank for rank in range(world_size) if rank not in records]
    mismatch = _first_mismatch(records)
    if mismatch is not None:
        message = _diverged_message(records, *mismatch)
        if missing:
            message += f"\n{_stopped_line(missing, answer_timeout_s)}"
        return Verdict("diverged", message)
    if missing:
        return Verdict("stopped", _stopped_message(records, missing, answer_timeout_s))
    current = {rank: r.current() for rank, r in records.items()}
    if all(entry is not None for entry in current.values()):
        keys = {(e.group, e.seq) for e in current.values() if e is not None}
        if len(keys) > 1:
            return Verdict("diverged", _waits_differ_message(records))
        return Verdict("stuck", _stuck_message(records))
    return Verdict("straggler", _straggler_message(records))


def _first_mismatch(records: dict[int, RankRecord]) -> tuple[str, int] | None:
    """The first (group, seq), in the lowest rank's order, whose signatures differ."""
    by_key: dict[tuple[str, int], dict[int, CollectiveSignature]] = {}
    order: list[tuple[str, int]] = []
    for rank in sorted(records):
        for entry in records[rank].entries:
            key = (entry.group, entry.seq)
            if key not in by_key:
                by_key[key] = {}
                order.append(key)
            by_key[key][rank] = entry.signature()
    for key in order:
        if len(set(by_key[key].values())) > 1:
            return key
    return None


def _diverged_message(records: dict[int, RankRecord], group: str, seq: int) -> str:
    entries = {
        rank: next((e for e in r.entries if (e.group, e.seq) == (group, seq)), None)
        for rank, r in sorted(records.items())
    }
    signatures = [e.signature() for e in entries.values() if e is not None]
    counts = {s: signatures.count(s) for s in signatures}
    # The majority's signature; on a tie, the lowest rank's (first in ``signatures``).
    reference = max(counts, key=lambda s: (counts[s], -signatures.index(s)))
    diverged = [r for r, e in entries.items() if e is not None and e.signature() != reference]
    steps = sorted({e.step for e in entries.values() if e is not None})
    lines = [
        f"  rank {rank}: " + (e.describe() if e is not None else records[rank].describe())
        for rank, e in entries.items()
    ]
    return (
        f"FSDP ranks diverged at step {steps[0]}: rank(s) {diverged} issued a different "
        f"collective than rank(s) {[r for r in entries if r not in diverged]}:\n"
        + "\n".join(lines)
        + f"\n{mismatch_hint(signatures)}"
    )


def _waits_differ_message(records: dict[int, RankRecord]) -> str:
    lines = "\n".join(f"  rank {rank}: {r.describe()}" for rank, r in sorted(records.items()))
    return (
        "FSDP ranks diverged: every rank waits in a different collective (their "
        f"collectives were issued in different orders):\n{lines}\n{mismatch_hint([])}"
    )


def _stopped_line(missing: list[int], answer_timeout_s: float) -> str:
    return (
        f"rank(s) {missing} stopped answering: no flight record within "
        f"{answer_timeout_s:g} s (the backend killed the process, as gloo does on "
        "mismatched sizes, or it is frozen; see its own log)"
    )


def _stopped_message(
    records: dict[int, RankRecord], missing: list[int], answer_timeout_s: float
) -> str:
    # The collectives before: gloo may let the diverged one through on the rank that
    # received less than it expected, and fail only the next.
    lines = []
    for rank, record in sorted(records.items()):
        lines.append(f"  rank {rank}: {record.describe()}")
        current = record.current() or (record.entries[-1] if record.entries else None)
        before = record.entries[: record.entries.index(current)] if current else []
        lines += [f"    after {entry.describe()}" for entry in reversed(before[-_BEFORE:])]
    return (
        f"FSDP collective failed: {_stopped_line(missing, answer_timeout_s)}. "
        "What the other ranks were issuing, latest first:\n" + "\n".join(lines)
    )


def _stuck_message(records: dict[int, RankRecord]) -> str:
    lines = "\n".join(f"  rank {rank}: {r.describe()}" for rank, r in sorted(records.items()))
    return (
        "FSDP collective slow: every rank waits for the same collective, with the same "
        f"records (the network or the backend is slow or stuck):\n{lines}"
    )


def _straggler_message(records: dict[int, RankRecord]) -> str:
    waiting = [rank for rank, r in sorted(records.items()) if r.current() is not None]
    behind = [rank for rank in sorted(records) if rank not in waiting]
    lines = "\n".join(f"  rank {rank}: {r.describe()}" for rank, r in sorted(records.items()))
    return (
        f"FSDP straggler: rank(s) {behind} are behind; rank(s) {waiting} wait for them in "
        f"a collective. The records agree (no divergence):\n{lines}"
    )
