"""The GPU check: in one command, everything about dtensor_fsdp that only a GPU shows.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check --out $OUT  # one GPU, ~5 min (estimated)
    python3 benchmarks/gpu_check --only offload,w4_hpz           # rerun some rows
    python3 benchmarks/gpu_check --list                          # the rows
    python3 benchmarks/gpu_check --device cpu --only w2_fp32     # a row on CPU tensors

Every row compares ours (``dtensor_fsdp.fully_shard``) with torch's ``fully_shard`` on
the same model, seed and tokens, and with the plain model where the arithmetic allows:
W=1 on NCCL, and W=2, W=4 (hpZ) and HSDP 2x2 on gloo with CUDA tensors on the one GPU
(NCCL refuses two ranks on one device); fp32, bf16 mixed precision, CPU offload,
per-block compile, explicit prefetch, quantized communication; peak memory and step
times against torch's and the plain model's; one profiled step per layout; ``plan()``'s
peak against the measured one; CUDA memory across steps and ``CommTrace``'s device
times; and the main job (``train.py``) and ``bench_train.py`` under torchrun. Each row
runs in its own processes under a deadline, so a failure or a hang stops only that
row; the script prints each row's detail, then one table, and exits 1 on any MISMATCH
or ERROR.

Without CUDA (and without ``--device cpu``) it prints that it skipped, and exits 0.
``--device cpu`` runs the rows on CPU tensors and gloo (W=1 too), tiny models: the
same code paths but CUDA's own, for testing the check itself.

Runs on the lent GPU machines' image as it is (Python 3.12, torch 2.11, no expecttest):
nothing here or in what it imports needs expecttest.
"""

import argparse
import dataclasses
import gzip
import json
import os
import platform
import shutil
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import dtensor_fsdp
from gpu_check import frameworks, graph, jobs, post_training, probes, rows
from gpu_check.launch import RankSpec, RowError, run_ranks
from gpu_check.report import (
    Outcome,
    RowResult,
    exit_status,
    failed_row,
    format_report,
    row_result,
)
from gpu_check.report import to_json as results_json

MiB = 2**20
PACK_LIMIT = 15 * MiB  # per tar: the device tool brings back files of at most 16 MiB
MAX_PACKS = 6  # 8 files come back: the table, the JSON and these
CPU_TIMEOUT_FACTOR = 3  # tiny models, but 2-4 ranks on a couple of shared cores
MIN_ROW_S = 15.0  # less left than this: the row is not started
STDOUT_DETAIL_CHARS = 600  # a row's detail on the terminal (a traceback: its end is cut)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    world_size: int  # 0: the row launches its own commands (torchrun, one process)
    layout: str  # "{backend}" becomes nccl or gloo
    what: str
    run: Callable[..., Outcome]
    timeout_s: float  # on CUDA
    cuda_only: bool = False


ROWS = [
    Row("fp32", 1, "W=1 {backend}", "fp32: ours = torch bitwise, ~ plain; peak, time, "
        "profile", rows.fp32, 120),
    Row("bf16", 1, "W=1 {backend}", "bf16 mixed precision (math SDPA): ours = torch "
        "bitwise; peak, time", rows.bf16, 120),
    Row("offload", 1, "W=1 {backend}", "CPU offload: ours = torch, ~ plain; shards, "
        "grads, states on CPU; grads pinned", rows.offload, 120),
    Row("w2_fp32", 2, "W=2 gloo", "gloo-on-CUDA: ours = torch, ~ plain; time, profile",
        rows.w2_fp32, 120),
    Row("w2_bf16", 2, "W=2 gloo", "bf16 mixed precision: ours = torch", rows.w2_bf16, 120),
    Row("w2_prefetch", 2, "W=2 gloo", "explicit forward/backward prefetch: ours = torch, "
        "~ plain", rows.w2_prefetch, 120),
    Row("mechanisms", 2, "W=2 gloo", "memory steady across steps (no cudaMalloc); "
        "CommTrace device times", probes.mechanisms, 90, cuda_only=True),
    Row("quant", 2, "W=2 gloo", "quantized all-gather/reduce-scatter within the wire "
        "format's bound of ours exact", probes.quant, 120),
    Row("w4_hpz", 4, "W=4 gloo hpZ", "reshard_after_forward=2: ours ~ torch (4-rank "
        "sums), = ours without hpZ; profile", rows.w4_hpz, 150),
    Row("hsdp_2x2", 4, "2x2 gloo HSDP", "HSDP: ours = torch, ~ plain; profile",
        rows.hsdp_2x2, 150),
    Row("plan", 1, "W=1 {backend}", "plan()'s predicted peak within 5% of the measured",
        probes.plan_peak, 120),
    Row("compile", 1, "W=1 {backend}", "per-block inductor (fullgraph): ours = torch, "
        "0 graph breaks", rows.compile_blocks, 240),
    Row("accelerate", 1, "W=1 {backend}", "accelerate's FSDP2 plugin, prepare(model, "
        "optimizer), grad accum: ours (use_dtensor_fsdp) = torch bitwise",
        frameworks.accelerate_fsdp2, 120, cuda_only=True),
    Row("phase_offload", 1, "W=1 {backend}", "offload_states/reload_states: device memory "
        "<= 5% after, each way <= 1.5x a pinned copy, round trip bitwise",
        post_training.phase_offload, 120, cuda_only=True),
    Row("weight_sync", 2, "W=2 gloo", "stream_weights = get_model_state_dict(full), fp32 "
        "and bf16, device tensors", post_training.weight_sync, 120),
    Row("train_flags", 0, "torchrun W=1 {backend}", "train.py bf16, grad-accum 2, "
        "offload, AC, meta-init, compile: trains, = reference", jobs.train_flags, 300),
    Row("bench_train", 0, "torchrun W=1 {backend}", "bench_train.py --impls "
        "ours,torch,unsharded", lambda ctx: jobs.bench_train(ctx, profile=False), 150),
    Row("bench_profile", 0, "torchrun W=1 {backend}", "the same with --profile",
        lambda ctx: jobs.bench_train(ctx, profile=True), 150),
    # Issue 39's GPU targets, unverified when written (no GPU was lent to that session).
    Row("graph_targets", 0, "fake W=8, one process", "bench_graph.py: graph 8B-shaped "
        "<= 0.80x torch eager; 0.88B with CUDA graphs busy >= 90%", graph.graph_targets,
        540, cuda_only=True),
    Row("symm_mem", 1, "W=1 {backend}", "set_symm_mem_for_comm: = default strategies "
        "bitwise", graph.symm_mem, 120, cuda_only=True),
]  # fmt: skip
ROW_NAMES = [row.name for row in ROWS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto",
        help="auto: CUDA if present, else skip (exit 0); cpu: every row on CPU tensors",
    )  # fmt: skip
    parser.add_argument("--only", metavar="ROW[,ROW]", help="run only these rows (see --list)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument(
        "--out", metavar="DIR", type=Path,
        help="write gpu_check.txt, gpu_check.json and artifacts_N.tar (profiler traces and "
        "logs, gzipped; at most 6 of 15 MiB) here, e.g. $OUT on the device tool",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="the small model everywhere and fewer timed steps (a second, shorter lease)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-s", type=float, default=540.0,
        help="rows not started within this many seconds are ERROR (default 540: the "
        "device tool's 600 s command limit less packing)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = ROW_NAMES if args.only is None else [n for n in args.only.split(",") if n]
    unknown = [name for name in names if name not in ROW_NAMES]
    if unknown or not names:
        parser.error(f"--only: unknown rows {unknown}; the rows are {','.join(ROW_NAMES)}")
    args.rows = [row for row in ROWS if row.name in names]
    return args


def device_type(choice: str) -> str | None:
    """The rows' device: "cuda", "cpu", or None (auto without CUDA: skip)."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else None
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda, but torch sees no CUDA device")
    return choice


def layout_of(row: Row, device: str) -> str:
    return row.layout.format(backend="nccl" if device == "cuda" else "gloo")


def list_rows() -> str:
    width = max(len(name) for name in ROW_NAMES)
    return "\n".join(f"{r.name:<{width}}  {layout_of(r, 'cuda'):<22}  {r.what}" for r in ROWS)


def run_row(row: Row, device: str, quick: bool, work: Path, timeout_s: float) -> list[Outcome]:
    """The row's outcomes, by rank (one for a command row). Raises RowError."""
    logs, artifacts = work / "logs", work / "artifacts"
    if row.world_size == 0:
        scratch = Path(tempfile.mkdtemp(prefix=f"gpu_check_{row.name}_", dir=work))
        ctx = jobs.JobContext(device, quick, logs, artifacts, scratch, timeout_s)
        try:
            return [row.run(ctx)]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    store = tempfile.mkdtemp(prefix=f"store_{row.name}_", dir=work)
    backend = "nccl" if device == "cuda" and row.world_size == 1 else "gloo"
    specs = [
        RankSpec(
            r, row.world_size, device, backend, os.path.join(store, "store"), str(artifacts), quick
        )
        for r in range(row.world_size)
    ]
    rank_logs = [logs / f"{row.name}_rank{r}.log" for r in range(row.world_size)]
    return run_ranks(row.run, specs, rank_logs, timeout_s)


def run_rows(
    selected: list[Row], device: str, quick: bool, budget_s: float, work: Path
) -> list[RowResult]:
    (work / "logs").mkdir(parents=True)
    (work / "artifacts").mkdir()
    deadline = time.monotonic() + budget_s
    results = []
    for index, row in enumerate(selected, 1):
        layout, start = layout_of(row, device), time.monotonic()
        timeout = row.timeout_s * (1 if device == "cuda" else CPU_TIMEOUT_FACTOR)
        timeout = min(timeout, deadline - start)
        if row.cuda_only and device != "cuda":
            result = failed_row(row.name, layout, "SKIP", "needs CUDA", 0.0)
        elif timeout < MIN_ROW_S:
            result = failed_row(row.name, layout, "ERROR", "not run: --budget-s spent", 0.0)
        else:
            try:
                outcomes = run_row(row, device, quick, work, timeout)
                result = row_result(row.name, layout, outcomes, time.monotonic() - start)
            except RowError as error:
                result = failed_row(row.name, layout, "ERROR", str(error), time.monotonic() - start)
            except Exception:  # noqa: BLE001 - a broken row must not stop the others
                error = traceback.format_exc().strip()
                detail = f"{error.splitlines()[-1]}\n{error}"
                result = failed_row(row.name, layout, "ERROR", detail, time.monotonic() - start)
        results.append(result)
        print(f"[{index}/{len(selected)}] {row.name}: {result.verdict} ({result.seconds:.0f} s)",
              flush=True)  # fmt: skip
    return results


def run_info(device: str, seconds: float) -> dict[str, str]:
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    return {
        "device": name, "torch": torch.__version__, "python": platform.python_version(),
        "dtensor_fsdp": str(Path(dtensor_fsdp.__file__).parent), "total_s": f"{seconds:.0f}",
    }  # fmt: skip


def write_out(
    out: Path, report: str, results: list[RowResult], info: dict[str, str], work: Path
) -> None:
    """The report, the JSON, and the logs and traces (gzipped) in tars of <= 15 MiB."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.txt").write_text(report)
    (out / "gpu_check.json").write_text(json.dumps(results_json(results, info), indent=1))
    files = _gzipped(work / "artifacts") + _gzipped(work / "logs")
    packs: list[list[Path]] = []
    current: list[Path] = []
    filled = 0
    for path in sorted(files, key=lambda p: p.stat().st_size):  # small first: logs, then traces
        size = path.stat().st_size
        if current and filled + size > PACK_LIMIT:
            packs.append(current)
            current, filled = [], 0
        if size > PACK_LIMIT or len(packs) == MAX_PACKS:
            print(f"gpu_check: left out {path.name} ({size / MiB:.1f} MiB): no room", flush=True)
            continue
        current.append(path)
        filled += size
    for index, pack in enumerate([*packs, current] if current else packs, 1):
        with tarfile.open(out / f"artifacts_{index}.tar", "w") as tar:
            for path in pack:
                tar.add(path, arcname=f"{path.parent.name}/{path.name}")


def _gzipped(folder: Path) -> list[Path]:
    """Every file in ``folder``, gzipped (the ones not gzipped yet replaced)."""
    packed = []
    for path in sorted(folder.iterdir()):
        if path.suffix != ".gz":
            target = path.with_name(path.name + ".gz")
            with open(path, "rb") as raw, gzip.open(target, "wb") as sink:
                shutil.copyfileobj(raw, sink)
            path.unlink()
            path = target
        packed.append(path)
    return packed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(list_rows())
        return 0
    device = device_type(args.device)
    if device is None:
        print("gpu_check: skipped: no CUDA device (--device cpu runs the rows on CPU tensors)")
        return 0
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        results = run_rows(args.rows, device, args.quick, args.budget_s, work)
        info = run_info(device, time.monotonic() - start)
        header = " | ".join(f"{key} {value}" for key, value in info.items())
        # Details cut short on the terminal: the device tool returns the output's end.
        print(
            f"\n{format_report(results, STDOUT_DETAIL_CHARS)}\n\ngpu_check | {header}", flush=True
        )
        if args.out is not None:
            report = f"gpu_check | {header}\n\n{format_report(results)}\n"
            write_out(args.out, report, results, info, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_status(results)
