"""What the flight records of every rank say about a stuck or failed FSDP collective.

Pure functions over the records the ranks gave (observe/watchdog.py gathers them
through the c10d store): every rank runs the same diagnosis on the same records, so
every rank reaches the same verdict and raises (or warns) with the same message.

[Note: no verdict from silence]
A rank is declared diverged or failed only on positive evidence; a rank that says
nothing is never judged dead for it. A rank answers a comparison from its watchdog
thread, which needs the GIL: a healthy rank busy in one long C call that holds it (a
``torch.save`` into a memory buffer, a big ``pickle.dumps``, a regular expression)
cannot answer for as long, however short the answer timeout. What counts as evidence:

- records that disagree: two ranks issued different collectives at the same place
  (same process group, same sequence number), whether the records were given live or
  published earlier (a record, once true, stays true), or every rank answers live
  while waiting in a collective that no other rank has completed;
- a backend failure: some rank's wait raised the backend's error (gloo's "Connection
  closed by peer" when a process died, its own timeout at the process group's timeout,
  an aborted communicator), reported live or in its published record.

Verdicts:

- **diverged** (error): the records disagree.
- **failed** (error): a backend failure; the ranks that gave nothing are named as the
  ones that stopped answering, beside what the others were issuing.
- **silent** (a warning): some ranks gave no live answer, nothing else is known. The
  others wait on; the backend's own timeout (the process group's) ends a wait that
  never ends, and that failure is evidence.
- **straggler** (a warning): every rank answered, the records agree and some ranks are
  merely behind (not waiting in FSDP).
- **stuck** (a warning): every rank waits in a collective and the records agree (the
  same one, or one that another rank has completed since): the backend or the network.
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
    """What one rank gave: its last collectives, oldest first."""

    rank: int
    entries: list[Entry]
    error: str | None  # the backend error its wait raised, if any
    # None: its live answer to the comparison under way. Otherwise the rank did not
    # answer, and this is the record it published itself (when a wait outlasted its
    # first slice, or failed), that many seconds before.
    published_age_s: float | None = None

    @staticmethod
    def from_json(value: dict[str, Any], published_age_s: float | None = None) -> "RankRecord":
        entries = [Entry.from_row(row) for row in value["entries"]]
        return RankRecord(value["rank"], entries, value["error"], published_age_s)

    @property
    def is_live(self) -> bool:
        return self.published_age_s is None

    def current(self) -> Entry | None:
        """The collective this rank's host is blocked on (or whose wait failed)."""
        return next((e for e in reversed(self.entries) if e.state in ("waiting", "failed")), None)

    def describe(self) -> str:
        entry = self.current() or (self.entries[-1] if self.entries else None)
        text = entry.describe() if entry is not None else "no FSDP collective yet"
        if entry is not None and entry.state not in ("waiting", "failed"):
            text += "; not waiting in FSDP (busy, or blocked outside FSDP)"
        if self.error is not None:
            text += f"; the backend raised: {self.error}"
        if not self.is_live:
            text = f"no answer; its record published {self.published_age_s:.1f} s before: {text}"
        return text


@dataclass(frozen=True)
class Verdict:
    kind: str  # "diverged", "failed", "silent", "straggler", "stuck"
    message: str

    @property
    def is_error(self) -> bool:
        """Only on positive evidence: see [Note: no verdict from silence]."""
        return self.kind in ("diverged", "failed")


def diagnose(records: dict[int, RankRecord], world_size: int, answer_timeout_s: float) -> Verdict:
    """The verdict on the records the ranks gave (``records``, by rank: live answers,
    or what a rank that did not answer had published)."""
    silent = [
        rank for rank in range(world_size) if rank not in records or not records[rank].is_live
    ]
    mismatch = _first_mismatch(records)
    if mismatch is not None:
        message = _diverged_message(records, *mismatch)
        if silent:
            message += f"\n{_stopped_line(silent, answer_timeout_s)}"
        return Verdict("diverged", message)
    if any(record.error is not None for record in records.values()):
        return Verdict("failed", _failed_message(records, silent, answer_timeout_s))
    if silent:
        return Verdict("silent", _silent_message(records, silent, answer_timeout_s))
    current = {rank: r.current() for rank, r in records.items()}
    if all(entry is not None for entry in current.values()):
        if _wait_for_each_other(records):
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


def _wait_for_each_other(records: dict[int, RankRecord]) -> bool:
    """Whether every rank (all answered live, all waiting) waits in a different
    collective than some other, none of which another rank has completed. The answers
    are not simultaneous: a rank may already be past the collective another was
    waiting for when it answered, and then it has completed it (a collective completes
    on a rank only once every rank joined it), which is no evidence of divergence."""
    current = {rank: r.current() for rank, r in records.items()}
    keys = {(e.group, e.seq) for e in current.values() if e is not None}
    if len(keys) < 2:
        return False
    completed = {(e.group, e.seq) for r in records.values() for e in r.entries if e.state == "done"}
    return not keys & completed


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
        f"rank(s) {missing} stopped answering: no answer within {answer_timeout_s:g} s "
        "(the backend killed the process, as gloo does on mismatched sizes, it exited, or "
        "it is frozen; see its own log)"
    )


def _rank_lines(records: dict[int, RankRecord], missing: list[int]) -> list[str]:
    """Each rank's current collective and the ones before it (gloo may let a diverged
    collective through on the rank that received less than it expected, and fail only
    the next), latest first; a rank that gave nothing at all as such."""
    lines = []
    for rank in sorted({*records, *missing}):
        record = records.get(rank)
        if record is None:
            lines.append(f"  rank {rank}: no answer, and no record published")
            continue
        lines.append(f"  rank {rank}: {record.describe()}")
        current = record.current() or (record.entries[-1] if record.entries else None)
        before = record.entries[: record.entries.index(current)] if current else []
        lines += [f"    after {entry.describe()}" for entry in reversed(before[-_BEFORE:])]
    return lines


def _failed_message(
    records: dict[int, RankRecord], missing: list[int], answer_timeout_s: float
) -> str:
    failed = sorted(rank for rank, record in records.items() if record.error is not None)
    stopped = f"; {_stopped_line(missing, answer_timeout_s)}" if missing else ""
    return (
        f"FSDP collective failed: the backend failed the wait of rank(s) {failed}{stopped}. "
        "What each rank was issuing, latest first:\n" + "\n".join(_rank_lines(records, missing))
    )


def _silent_message(
    records: dict[int, RankRecord], missing: list[int], answer_timeout_s: float
) -> str:
    waiting = [rank for rank, r in sorted(records.items()) if r.is_live and r.current()]
    return (
        f"FSDP straggler: rank(s) {missing} gave no answer within {answer_timeout_s:g} s "
        "and are not known to have failed (busy in a call that holds the GIL, such as "
        "torch.save into a memory buffer, a large pickle or a slow regular expression; or "
        f"frozen); rank(s) {waiting} wait for them. No error: the wait goes on, and the "
        "backend's own timeout (the process group's) fails it if they never come. What "
        "is known, latest first:\n" + "\n".join(_rank_lines(records, missing))
    )


def _stuck_message(records: dict[int, RankRecord]) -> str:
    lines = "\n".join(f"  rank {rank}: {r.describe()}" for rank, r in sorted(records.items()))
    return (
        "FSDP collective slow: every rank waits in a collective, with records that agree "
        f"(the network or the backend is slow or stuck):\n{lines}"
    )


def _straggler_message(records: dict[int, RankRecord]) -> str:
    waiting = [rank for rank, r in sorted(records.items()) if r.current() is not None]
    behind = [rank for rank in sorted(records) if rank not in waiting]
    lines = "\n".join(f"  rank {rank}: {r.describe()}" for rank, r in sorted(records.items()))
    return (
        f"FSDP straggler: rank(s) {behind} are behind; rank(s) {waiting} wait for them in "
        f"a collective. The records agree (no divergence):\n{lines}"
    )
