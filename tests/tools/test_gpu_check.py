"""benchmarks/gpu_check/, the GPU check, on this CPU machine: what of it runs without
a GPU. Its command line (``--only``, ``--list``, the skip without CUDA), the table and
the exit status, the comparison that turns one flipped bit into a MISMATCH, the
deadline that turns a hung or raising row into an ERROR, and a whole gloo row on CPU
tensors (``--device cpu``): ours against torch's ``fully_shard`` and the plain model,
as the GPU runs it. And that nothing it imports needs expecttest (the lent GPU
machines have none).
"""

import dataclasses
import functools
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

REPO = Path(__file__).resolve().parents[2]
# The check's modules import each other as ``gpu_check.*`` and the benchmarks' shared
# ones as ``common.*``, and so do the ranks it spawns (spawn hands them this process's
# sys.path).
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check import check, frameworks, probes, rows
from gpu_check.compare import compare_bitwise
from gpu_check.launch import RankSpec, RowError, run_ranks
from gpu_check.report import (
    Check,
    Outcome,
    RowResult,
    exit_status,
    format_report,
    row_result,
)
from gpu_check.training import Rank, Record, Setting, offload_problems

from dtensor_fsdp import CommEvent, CommTrace, DeviceTiming


def test_only_selects_rows_in_table_order() -> None:
    args = check.parse_args(["--only", "w4_hpz,fp32", "--device", "cpu"])
    assert [row.name for row in args.rows] == ["fp32", "w4_hpz"]
    assert (args.device, args.quick, args.out, args.budget_s) == ("cpu", False, None, 540.0)


def test_only_refuses_an_unknown_row(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        check.parse_args(["--only", "fp32,fp64"])
    assert exit_info.value.code == 2
    assert "--only: unknown rows ['fp64']; the rows are fp32,bf16," in capsys.readouterr().err


def test_list_names_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == check.ROW_NAMES


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_skips_cleanly_without_cuda() -> None:
    # As CI runs it: its own interpreter, the default arguments.
    done = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        [sys.executable, "benchmarks/gpu_check"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (
        0, "gpu_check: skipped: no CUDA device (--device cpu runs the rows on CPU tensors)"
    )  # fmt: skip


def test_nothing_imported_needs_expecttest() -> None:
    # The device image has no expecttest: import everything the check runs with it
    # made unimportable (train.py and bench_train.py too: the check launches them).
    code = (
        "import sys; sys.modules['expecttest'] = None; sys.path[:0] = ['benchmarks', '.']; "
        "import gpu_check.check, gpu_check.rows, gpu_check.probes, gpu_check.jobs, bench_train, train"
    )
    done = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def _result(name: str, verdict: str, detail: str, **metrics: float) -> RowResult:
    return RowResult(name, "W=2 gloo", verdict, 12.3, detail, metrics)


def test_table() -> None:
    results = [
        _result("fp32", "ok", "ours = torch: bitwise", time_vs_torch=0.9987,
                time_vs_plain=1.0213, peak_vs_torch=1.0),
        _result("offload", "MISMATCH", "ours offload: 2 misplaced: ['after fully_shard: "
                "tok_embeddings.weight param on cuda:0', 'after fully_shard: norm.weight "
                "param on cuda:0']"),
        _result("mechanisms", "SKIP", "needs CUDA"),
    ]  # fmt: skip
    # On the terminal a detail is cut (its full text goes to the --out files); the
    # table comes last, where the device tool's output tail keeps it.
    assert_expected_inline(
        format_report(results, detail_chars=60),
        """\
fp32 [ok]: ours = torch: bitwise
offload [MISMATCH]: ours offload: 2 misplaced: ['after fully_shard: tok_embeddin [cut: the --out files hold all of it]
mechanisms [SKIP]: needs CUDA

row         layout    verdict   ours/torch  ours/plain  peak o/t  s   detail
fp32        W=2 gloo  ok        0.999       1.021       1.000     12  ours = torch: bitwise
offload     W=2 gloo  MISMATCH  -           -           -         12  ours offload: 2 misplaced: ['after fully_shard: tok_embeddings.weight...
mechanisms  W=2 gloo  SKIP      -           -           -         12  needs CUDA

3 rows: 1 ok, 1 MISMATCH, 1 SKIP (mechanisms)""",
    )


def test_a_check_failing_on_one_rank_fails_the_row() -> None:
    passed = Outcome([Check("ours = torch", True, "bitwise")], {"time_vs_torch": 1.0})
    failed = Outcome([Check("ours = torch", False, "param w: max |diff| 1e-07")])
    result = row_result("w2_fp32", "W=2 gloo", [passed, failed], 3.0)
    assert (result.verdict, result.detail) == (
        "MISMATCH", "rank 1: ours = torch: param w: max |diff| 1e-07"
    )  # fmt: skip
    assert exit_status([result]) == 1
    ok = row_result("w2_fp32", "W=2 gloo", [passed, passed], 3.0)
    assert (ok.verdict, ok.metrics) == ("ok", {"time_vs_torch": 1.0})
    assert exit_status([ok, _result("mechanisms", "SKIP", "needs CUDA")]) == 0
    assert exit_status([ok, _result("plan", "ERROR", "timed out")]) == 1


def test_a_row_that_skips_is_a_visible_skip_and_passes() -> None:
    # A missing optional package must neither fail the run nor read as a pass.
    skipped = Outcome()
    skipped.skip("accelerate is not installed (pip install accelerate)")
    skip = row_result("accelerate", "W=1 NCCL", [skipped], 0.5)
    assert (skip.verdict, skip.detail) == (
        "SKIP", "accelerate is not installed (pip install accelerate)"
    )  # fmt: skip
    ok = row_result("fp32", "W=1 NCCL", [Outcome([Check("ours = torch", True, "bitwise")])], 1.0)
    assert exit_status([ok, skip]) == 0
    assert exit_status([ok, skip, _result("offload", "MISMATCH", "param w")]) == 1
    assert_expected_inline(
        format_report([ok, skip]),
        """\
fp32 [ok]: ours = torch: bitwise
accelerate [SKIP]: accelerate is not installed (pip install accelerate)

row         layout    verdict  ours/torch  ours/plain  peak o/t  s  detail
fp32        W=1 NCCL  ok       -           -           -         1  ours = torch: bitwise
accelerate  W=1 NCCL  SKIP     -           -           -         0  accelerate is not installed (pip install accelerate)

2 rows: 1 ok, 1 SKIP (accelerate)""",
    )


def test_accelerate_row_skips_without_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = frameworks.importlib.util.find_spec
    monkeypatch.setattr(
        frameworks.importlib.util, "find_spec",
        lambda name, *args: None if name == "accelerate" else real_find_spec(name, *args),
    )  # fmt: skip
    spec = RankSpec(0, 1, "cuda", "nccl", "unused", "unused", quick=True)
    result = row_result("accelerate", "W=1 NCCL", [frameworks.accelerate_fsdp2(spec)], 0.0)
    assert (result.verdict, result.detail) == (
        "SKIP", "accelerate is not installed (pip install accelerate)"
    )  # fmt: skip


def _record(param: torch.Tensor) -> Record:
    grads = {"w": torch.ones(3)}
    return Record(losses=[2.5, 2.25], first_grads=grads, last_grads=grads, params={"w": param})


def test_one_flipped_bit_is_a_mismatch() -> None:
    param = torch.tensor([1.0, 2.0, 3.0])
    nudged = param.clone()
    nudged[1] = torch.nextafter(nudged[1], torch.tensor(3.0))  # one ulp
    assert compare_bitwise("ours = torch", _record(param), _record(param.clone())).ok
    check = compare_bitwise("ours = torch", _record(param), _record(nudged))
    assert (check.ok, check.detail) == (False, "param w: max |diff| 2.38e-07")


def _hang(spec: RankSpec) -> None:
    time.sleep(600)


def _raise(spec: RankSpec) -> None:
    raise ValueError("broken row")


def _specs(tmp_path: Path, world_size: int) -> list[RankSpec]:
    store = str(tmp_path / "store")
    return [
        RankSpec(r, world_size, "cpu", "gloo", store, str(tmp_path), quick=False)
        for r in range(world_size)
    ]


def test_a_hung_or_raising_row_is_stopped(tmp_path: Path) -> None:
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    start = time.monotonic()
    with pytest.raises(RowError, match=r"ranks \[0, 1\] left no result within 5 s"):
        run_ranks(_hang, _specs(tmp_path, 2), logs, timeout_s=5)
    assert time.monotonic() - start < 60  # killed, not waited for
    with pytest.raises(RowError, match="rank 0 of 1: ValueError: broken row"):
        run_ranks(_raise, _specs(tmp_path, 1), logs[:1], timeout_s=60)


def test_a_mismatching_study_fails(tmp_path: Path) -> None:
    # The row machinery itself, on one gloo rank: "torch" here trains in bf16, so the
    # bitwise comparison must fail and say where.
    study = rows.Study(
        {"ours": Setting("ours"), "torch": Setting("torch", bf16=True)}, plain=(), timed=False
    )
    run = functools.partial(rows.run_study, study=study, row="broken")
    (outcome,) = run_ranks(run, _specs(tmp_path, 1), [tmp_path / "rank0.log"], timeout_s=180)
    (check,) = [c for c in outcome.checks if c.name == "ours = torch"]
    assert not check.ok and check.detail.startswith("loss at step 1: ")


def test_gloo_row_on_cpu_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """w2_fp32 as the GPU runs it, on CPU tensors: ours bitwise torch's, close to the
    plain model, timed and profiled, and its files written as for the device tool."""
    assert check.main(["--device", "cpu", "--only", "w2_fp32", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    checks = {check["name"]: check for check in row["checks"]}
    assert row["verdict"] == "ok" and checks.keys() == {"ours = torch", "ours ~ plain"}
    assert checks["ours = torch"]["detail"].startswith("bitwise")
    assert {"time_vs_torch", "time_vs_plain", "peak_vs_torch"} <= row["metrics"].keys()
    assert "w2_fp32  W=2 gloo  ok" in (tmp_path / "gpu_check.txt").read_text()
    with tarfile.open(tmp_path / "artifacts_1.tar") as tar:
        names = sorted(tar.getnames())
    assert names == [
        "artifacts/w2_fp32_ours_rank0.json.gz",
        "artifacts/w2_fp32_torch_rank0.json.gz",
        "logs/w2_fp32_rank0.log.gz", "logs/w2_fp32_rank1.log.gz",
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "artifacts_1.tar", "gpu_check.json", "gpu_check.txt"
    ]  # fmt: skip


class _Event:
    """A device event at a fixed time (ms), as torch.cuda.Event answers."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


def _collective(kind: str, issued: float, waited: float, done: float) -> CommEvent:
    timing = DeviceTiming(_Event(issued), _Event(waited), _Event(done))
    return CommEvent(kind, "layers.0", 2, 1024, 0.0, 0.0, 0.0, "forward", timing)


def test_device_timings_on_every_collective_and_positive() -> None:
    events = [_collective("all_gather", 0, 1, 2), _collective("reduce_scatter", 3, 3.5, 4)]
    outcome = Outcome()
    probes._check_device_timings(outcome, CommTrace(events))
    assert outcome.checks == [
        Check(
            "device timings", True,
            "2 collectives (all_gather, reduce_scatter), issue-to-wait-end 1.000-2.000 ms, "
            "exposed 0.500-1.000 ms",
        )
    ]  # fmt: skip
    untimed = [events[0], dataclasses.replace(events[1], device=None)]
    instant = [events[0], _collective("reduce_scatter", 3, 3, 3)]  # nothing measured
    for broken in (untimed, instant):
        outcome = Outcome()
        probes._check_device_timings(outcome, CommTrace(broken))
        assert not outcome.checks[0].ok, outcome.checks[0].detail


def test_offload_check_names_a_param_off_the_cpu() -> None:
    # On a GPU, DTensor.from_local moved offloaded shards to the device; "meta" stands
    # for any device but the CPU here.
    model = torch.nn.Linear(2, 2)
    model.bias = torch.nn.Parameter(torch.zeros(2, device="meta"))
    optimizer = torch.optim.AdamW(model.parameters())
    rank = Rank(torch.device("cpu"), mesh=None, artifacts="")
    assert offload_problems(model, optimizer, rank, "after fully_shard") == [
        "after fully_shard: bias param on meta"
    ]
