"""Draw a torch.profiler Chrome trace as a PNG timeline: one row per GPU stream (or, in
a CPU-only trace, per thread), collectives in red.

    python benchmarks/plot_timeline.py prof/ours_rank0.json -o prof/ours_timeline.png
    python benchmarks/plot_timeline.py prof/ours_rank0.json --step 2 -o step2.png
    python benchmarks/plot_timeline.py prof/ours_rank0.json --start-ms 10 --end-ms 40

The window is, by default, the last ``ProfilerStep#n`` range (``bench_train.py
--profile`` records one per step); ``--step n`` picks another, ``--start-ms/--end-ms``
(from the trace's first event) or ``--last-ms`` a window by time. A trace that holds GPU
kernels is drawn with one row per stream, so an all-gather kernel on the side stream
shows up next to, and overlapping, the compute kernels of the compute stream; a CPU
trace with one row per thread (gloo runs collectives on its own threads). It also
prints how long collectives ran in the window and how much of that overlapped
non-collective work on another row. Needs matplotlib (the ``[bench]`` extra) only to
draw.
"""

import argparse
import dataclasses
import gzip
import json
import os
import re

COLLECTIVE = re.compile(
    r"nccl|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|gloo|c10d::", re.IGNORECASE
)
# Ranges that wrap other events rather than being work of their own; a CPU
# user_annotation is kept when it names a collective (gloo's "gloo:all_gather" ranges on
# its worker threads are record_function ranges).
SKIPPED_CATEGORIES = {"gpu_user_annotation", "Trace", "python_function"}
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP = re.compile(r"ProfilerStep#(\d+)")


@dataclasses.dataclass(frozen=True)
class Interval:
    start_ms: float
    end_ms: float
    name: str
    is_collective: bool


@dataclasses.dataclass
class Row:
    label: str
    intervals: list[Interval]


def load_trace(path: str) -> dict:
    """A Chrome trace JSON, gzipped when the name ends in .gz."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def _origin_us(events: list[dict]) -> float:
    return min((e["ts"] for e in events if e.get("ph") == "X"), default=0.0)


def parse_rows(trace: dict) -> list[Row]:
    """One row per (pid, tid) of the complete ("X") events; only GPU streams when the
    trace has GPU events. Times in ms from the trace's first complete event."""
    events = trace["traceEvents"]
    origin = _origin_us(events)
    names: dict[tuple, str] = {}
    for e in events:  # metadata: kineto may name a thread twice; the first is the thread's
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names.setdefault((e["pid"], e["tid"]), str(e["args"]["name"]).strip())
    work = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") not in SKIPPED_CATEGORIES
        and (e.get("cat") != "user_annotation" or COLLECTIVE.search(e["name"]))
    ]
    if any(e.get("cat") in GPU_CATEGORIES for e in work):
        work = [e for e in work if e.get("cat") in GPU_CATEGORIES]
    rows: dict[tuple, Row] = {}
    for e in work:
        key = (e["pid"], e["tid"])
        row = rows.setdefault(key, Row(names.get(key, f"{e['pid']}/{e['tid']}"), []))
        start = (e["ts"] - origin) / 1e3
        row.intervals.append(
            Interval(
                start, start + e.get("dur", 0) / 1e3, e["name"], bool(COLLECTIVE.search(e["name"]))
            )
        )
    return [rows[key] for key in sorted(rows, key=_natural)]


def _natural(key: tuple) -> tuple:
    """Numeric ids in numeric order (stream 7 before stream 20), names after them."""
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in key)


def step_windows(trace: dict) -> dict[int, tuple[float, float]]:
    """``ProfilerStep#n`` -> (start, end) in ms, on the same clock as ``parse_rows``."""
    events = trace["traceEvents"]
    origin = _origin_us(events)
    windows = {}
    for e in events:
        match = STEP.fullmatch(e.get("name", ""))
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and match:
            start = (e["ts"] - origin) / 1e3
            windows[int(match.group(1))] = (start, start + e["dur"] / 1e3)
    return windows


def clip(rows: list[Row], start_ms: float, end_ms: float) -> list[Row]:
    """The parts of each interval inside [start_ms, end_ms]; rows left empty are dropped."""
    out = []
    for row in rows:
        kept = [
            dataclasses.replace(i, start_ms=max(i.start_ms, start_ms), end_ms=min(i.end_ms, end_ms))
            for i in row.intervals
            if i.end_ms > start_ms and i.start_ms < end_ms
        ]
        if kept:
            out.append(Row(row.label, kept))
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions (each sorted, disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def collective_overlap(rows: list[Row]) -> tuple[float, float]:
    """(ms of collectives, ms of them overlapping non-collective work on another row),
    summed over rows. On a GPU trace: NCCL kernels against the other streams' kernels."""
    collective_ms = overlapped_ms = 0.0
    for index, row in enumerate(rows):
        ours = _union([(i.start_ms, i.end_ms) for i in row.intervals if i.is_collective])
        others = _union(
            [
                (i.start_ms, i.end_ms)
                for other_index, other in enumerate(rows)
                if other_index != index
                for i in other.intervals
                if not i.is_collective
            ]
        )
        collective_ms += _length(ours)
        overlapped_ms += _intersect(ours, others)
    return collective_ms, overlapped_ms


def plot(rows: list[Row], path: str, title: str, start_ms: float) -> None:
    """Collectives red and drawn last (on top of nested ops); the rest blue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(rows)))
    for y, row in enumerate(reversed(rows)):
        for is_collective, color in ((False, "tab:blue"), (True, "tab:red")):
            spans = [
                (i.start_ms - start_ms, i.end_ms - i.start_ms)
                for i in row.intervals
                if i.is_collective == is_collective
            ]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="none")
    ax.set_yticks(range(len(rows)), [row.label for row in reversed(rows)])
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(
        handles=[
            Patch(color="tab:red", label="collective"),
            Patch(color="tab:blue", label="other"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def choose_window(
    args: argparse.Namespace, trace: dict, rows: list[Row]
) -> tuple[float, float, str]:
    end_of_trace = max((i.end_ms for row in rows for i in row.intervals), default=0.0)
    if args.start_ms is not None or args.end_ms is not None:
        start, end = args.start_ms or 0.0, args.end_ms if args.end_ms is not None else end_of_trace
        return start, end, f"{start:.1f}-{end:.1f} ms"
    if args.last_ms is not None:
        return end_of_trace - args.last_ms, end_of_trace, f"last {args.last_ms:g} ms"
    steps = step_windows(trace)
    if not steps:
        return 0.0, end_of_trace, "whole trace"
    step = args.step if args.step is not None else max(steps)
    if step not in steps:
        raise SystemExit(f"no ProfilerStep#{step} in the trace; it has {sorted(steps)}")
    return *steps[step], f"ProfilerStep#{step}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz)")
    parser.add_argument("-o", "--output", help="PNG path (default: the trace's, .png)")
    parser.add_argument("--step", type=int, help="draw ProfilerStep#STEP (default: the last)")
    parser.add_argument("--start-ms", type=float, help="window start, ms from the first event")
    parser.add_argument("--end-ms", type=float, help="window end, ms from the first event")
    parser.add_argument("--last-ms", type=float, help="window: the trace's last LAST_MS ms")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    rows = parse_rows(trace)
    start, end, what = choose_window(args, trace, rows)
    rows = clip(rows, start, end)
    collective_ms, overlapped_ms = collective_overlap(rows)
    print(
        f"{what}: {end - start:.2f} ms, {len(rows)} rows; collectives {collective_ms:.2f} ms, "
        f"of which {overlapped_ms:.2f} ms overlap other work on another row"
    )
    output = args.output or re.sub(r"\.json(\.gz)?$", "", args.trace) + ".png"
    plot(rows, output, f"{os.path.basename(args.trace)} ({what})", start)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
