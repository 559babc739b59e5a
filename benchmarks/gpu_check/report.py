"""The GPU check's results: what a row's ranks return (``Outcome``), how the ranks'
outcomes become one verdict (``verdict_of``), the table, and the exit status.

Verdicts: ``ok`` (every check passed), ``MISMATCH`` (a check failed on some rank: values,
placements, memory), ``ERROR`` (the row raised, timed out, or was not run for lack of
time), ``SKIP`` (the row needs CUDA and runs on CPU tensors, or needs an optional
package that is missing: ``Outcome.skip``). SKIP never fails a run, and the report's last
line names the skipped rows, so a skip never reads as a pass. Timings never decide a
verdict: they are reported.
"""

import dataclasses
import math
from collections import Counter
from typing import Any

_DETAIL_WIDTH = 72  # the table's detail column; the full text comes before the table


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison a row makes; ``detail`` says what was compared and what was seen."""

    name: str
    ok: bool
    detail: str


@dataclasses.dataclass
class Outcome:
    """What one rank of a row found (rank 0's metrics and notes are the row's)."""

    checks: list[Check] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """``time_vs_torch``, ``time_vs_plain``, ``peak_vs_torch`` (ratios, ours over the
    other) and any other figure worth keeping in the JSON."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What is reported without a verdict (timings, figures)."""
    skipped: str | None = None
    """Why the rank ran nothing (an optional package missing): the row is a SKIP."""

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def skip(self, reason: str) -> None:
        self.skipped = reason


@dataclasses.dataclass
class RowResult:
    """One line of the table."""

    name: str
    layout: str
    verdict: str
    seconds: float
    detail: str
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def verdict_of(outcomes: list[Outcome]) -> tuple[str, str]:
    """(verdict, detail) of a row from its ranks' outcomes, by rank: MISMATCH if any
    check failed on any rank (the failures first, named by rank), else SKIP if a rank
    skipped (its reason), else ok."""
    failed = [
        f"rank {rank}: {check.name}: {check.detail}" if len(outcomes) > 1 else
        f"{check.name}: {check.detail}"
        for rank, outcome in enumerate(outcomes)
        for check in outcome.checks
        if not check.ok
    ]  # fmt: skip
    if failed:
        return "MISMATCH", "; ".join(failed)
    reasons = [outcome.skipped for outcome in outcomes if outcome.skipped is not None]
    if reasons:
        return "SKIP", reasons[0]
    passed = [f"{check.name}: {check.detail}" for check in outcomes[0].checks]
    return "ok", "; ".join(passed + outcomes[0].notes)


def row_result(name: str, layout: str, outcomes: list[Outcome], seconds: float) -> RowResult:
    verdict, detail = verdict_of(outcomes)
    first = outcomes[0]
    checks = [check for outcome in outcomes for check in outcome.checks]
    return RowResult(name, layout, verdict, seconds, detail, first.metrics, checks, first.notes)


def failed_row(name: str, layout: str, verdict: str, detail: str, seconds: float) -> RowResult:
    """A row that produced no outcome: ERROR (raised, timed out, not run) or SKIP."""
    assert verdict in ("ERROR", "SKIP")
    return RowResult(name, layout, verdict, seconds, detail)


def _ratio(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_WIDTH else text[: _DETAIL_WIDTH - 3] + "..."


def format_report(results: list[RowResult], detail_chars: int | None = None) -> str:
    """Each row's detail (cut to ``detail_chars``), then one line per row and a count
    of the verdicts: the table ends the report, so the end of a long output still holds
    it. Ratios are ours over the other (step time: median of interleaved steps; peak:
    allocated bytes over step 2)."""
    text = []
    for r in results:
        detail = r.detail
        if detail_chars is not None and len(detail) > detail_chars:
            detail = detail[:detail_chars] + " [cut: the --out files hold all of it]"
        text.append(f"{r.name} [{r.verdict}]: {detail}")
    header = ("row", "layout", "verdict", "ours/torch", "ours/plain", "peak o/t", "s", "detail")
    lines = [
        (
            r.name, r.layout, r.verdict, _ratio(r.metrics.get("time_vs_torch")),
            _ratio(r.metrics.get("time_vs_plain")), _ratio(r.metrics.get("peak_vs_torch")),
            f"{r.seconds:.0f}", _short(r.detail),
        )
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header) - 1)]
    text.append("")
    for row in [header, *lines]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        text.append("  ".join([*cells, row[-1]]).rstrip())
    text.extend(["", _summary(results)])
    return "\n".join(text)


def _summary(results: list[RowResult]) -> str:
    """One line: the count of each verdict, the skipped rows named (a skip is no pass)."""
    counts = Counter(r.verdict for r in results)
    skipped = ", ".join(r.name for r in results if r.verdict == "SKIP")
    parts = [
        f"{count} {verdict}" + (f" ({skipped})" if verdict == "SKIP" else "")
        for verdict, count in counts.items()
    ]
    return f"{len(results)} rows: " + ", ".join(parts)


def exit_status(results: list[RowResult]) -> int:
    """1 if any row is MISMATCH or ERROR, else 0: a SKIP (no CUDA, or an optional
    package missing) must never fail a run."""
    return int(any(r.verdict in ("MISMATCH", "ERROR") for r in results))


def to_json(results: list[RowResult], run: dict[str, Any]) -> dict[str, Any]:
    return {"run": run, "rows": [dataclasses.asdict(r) for r in results]}
