"""benchmarks/plot_timeline.py: Chrome trace -> rows of intervals -> PNG.

Not a comparison with torch's fully_shard: a benchmark tool reading torch.profiler's
trace format, checked on small hand-written traces shaped like the profiler's (GPU:
kernels with a stream per tid; CPU: cpu_op events, gloo's ranges on its threads).
Times are integer microseconds, so every ms value below is exact in binary (halves,
tenths are compared with approx).
"""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_timeline.py"
_spec = importlib.util.spec_from_file_location("plot_timeline", _PATH)
plot_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_timeline)


def _x(name, cat, pid, tid, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def _thread_name(pid, tid, name):
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


# Two profiled steps; in step 2 the all-gather on stream 20 runs beside stream 7's kernels.
GPU_TRACE = {
    "traceEvents": [
        _thread_name(0, 7, "stream 7 "),
        _thread_name(0, 20, "stream 20 "),
        _x("ProfilerStep#1", "user_annotation", 100, 100, 1000, 5000),  # [0, 5] ms
        _x("ProfilerStep#2", "user_annotation", 100, 100, 6000, 4000),  # [5, 9] ms
        _x("aten::mm", "cpu_op", 100, 100, 1100, 100),  # dropped: the trace has kernels
        _x("gemm", "kernel", 0, 7, 2000, 1000),  # [1, 2]
        _x("gemm", "kernel", 0, 7, 6000, 2000),  # [5, 7]
        _x("elementwise", "kernel", 0, 7, 8500, 1000),  # [7.5, 8.5]
        _x("ncclDevKernel_AllGather_RING_LL", "kernel", 0, 20, 6500, 2500),  # [5.5, 8]
        _x("Memcpy DtoD", "gpu_memcpy", 0, 20, 9200, 300),  # [8.2, 8.5]
        _x("FSDP::all_gather", "gpu_user_annotation", 0, 20, 6000, 3000),  # dropped
        {"ph": "s", "name": "fwdbwd", "pid": 100, "tid": 100, "ts": 1200, "id": 1},
    ]
}

# gloo's collective is a record_function range on its worker thread: kept.
CPU_TRACE = {
    "traceEvents": [
        _thread_name(100, 100, "thread 100 (python)"),
        _thread_name(100, 101, "thread 101 (pt_gloo_runloop)"),
        _x("ProfilerStep#1", "user_annotation", 100, 100, 1000, 5000),
        _x("aten::addmm", "cpu_op", 100, 100, 1000, 4000),  # [0, 4]
        _x("c10d::_allgather_base_", "cpu_op", 100, 100, 5000, 100),  # [4, 4.1]
        _x("gloo:all_gather", "user_annotation", 100, 101, 2000, 1000),  # [1, 2]
        _x("aten::copy_", "cpu_op", 100, 101, 2500, 200),  # [1.5, 1.7]
    ]
}


def _spans(row):
    return [(i.start_ms, i.end_ms, i.name, i.is_collective) for i in row.intervals]


def test_gpu_trace_rows_are_streams():
    rows = plot_timeline.parse_rows(GPU_TRACE)
    assert [row.label for row in rows] == ["stream 7", "stream 20"]
    assert _spans(rows[0]) == [
        (1.0, 2.0, "gemm", False),
        (5.0, 7.0, "gemm", False),
        (7.5, 8.5, "elementwise", False),
    ]
    assert _spans(rows[1]) == [
        (5.5, 8.0, "ncclDevKernel_AllGather_RING_LL", True),
        (pytest.approx(8.2), 8.5, "Memcpy DtoD", False),
    ]


def test_step_window_clip_and_overlap():
    windows = plot_timeline.step_windows(GPU_TRACE)
    assert windows == {1: (0.0, 5.0), 2: (5.0, 9.0)}
    rows = plot_timeline.clip(plot_timeline.parse_rows(GPU_TRACE), *windows[2])
    assert [len(row.intervals) for row in rows] == [2, 2]
    # The all-gather [5.5, 8] against stream 7's [5, 7] and [7.5, 8.5]: 1.5 + 0.5 ms.
    assert plot_timeline.collective_overlap(rows) == (2.5, 2.0)
    # Step 1 holds one gemm on stream 7 and nothing on stream 20.
    rows = plot_timeline.clip(plot_timeline.parse_rows(GPU_TRACE), *windows[1])
    assert [_spans(row) for row in rows] == [[(1.0, 2.0, "gemm", False)]]
    # A window cutting an interval keeps the part inside.
    rows = plot_timeline.clip(plot_timeline.parse_rows(GPU_TRACE), 6.0, 7.0)
    assert _spans(rows[0]) == [(6.0, 7.0, "gemm", False)]


def test_cpu_trace_rows_are_threads():
    rows = plot_timeline.parse_rows(CPU_TRACE)
    assert [row.label for row in rows] == ["thread 100 (python)", "thread 101 (pt_gloo_runloop)"]
    assert _spans(rows[0]) == [
        (0.0, 4.0, "aten::addmm", False),
        (4.0, pytest.approx(4.1), "c10d::_allgather_base_", True),
    ]
    assert _spans(rows[1]) == [
        (1.0, 2.0, "gloo:all_gather", True),
        (1.5, pytest.approx(1.7), "aten::copy_", False),
    ]
    # The c10d op [4, 4.1] overlaps nothing on thread 101; gloo's [1, 2] lies inside
    # addmm's [0, 4] on thread 100 (its own copy_ on thread 101 does not count).
    collective_ms, overlapped_ms = plot_timeline.collective_overlap(rows)
    assert collective_ms == pytest.approx(1.1)
    assert overlapped_ms == 1.0


def test_main_writes_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    trace_path = tmp_path / "ours_rank0.json.gz"  # gzipped, as the GPU command leaves it
    with gzip.open(trace_path, "wt") as f:
        json.dump(GPU_TRACE, f)
    monkeypatch.setattr("sys.argv", ["plot_timeline.py", str(trace_path)])
    plot_timeline.main()
    png = tmp_path / "ours_rank0.png"  # default: the trace's name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Default window: the last ProfilerStep.
    assert "ProfilerStep#2: 4.00 ms, 2 rows; collectives 2.50 ms, of which 2.00 ms" in (
        capsys.readouterr().out
    )
