"""Ranks whose control flow diverges, under ``torchrun``: torch's ``fully_shard`` (and
ours with the checks off) abort with SIGABRT or spread NaNs silently; ours with
``set_divergence_check`` / ``set_nonfinite_grad_check`` raises the same clear error on
every rank within seconds, before the diverging collective.

Each launch runs ``tests/observe/_divergence_job.py`` on 2 ranks, killed past a deadline.
"""

from pathlib import Path

import pytest

from tests._torchrun import Launch, torchrun
from tests.observe._divergence_job import CHECK_TIMEOUT_S, read_records

JOB = Path(__file__).with_name("_divergence_job.py")
DEADLINE_S = 90.0
# A check that agrees costs one small all-gather; a mismatch raises at once. The bound
# leaves room for a loaded 2-core CI machine.
WITHIN_S = 5.0
OURS = "skip_block,skip_same_size,unused_param,unused_param_fixed,nan,stalls"


def _run(tmp: Path, impl: str, scenarios: str) -> tuple[Launch, list[dict]]:
    out = tmp / impl
    launch = torchrun(
        JOB, "--impl", impl, "--scenarios", scenarios, "--out", str(out),
        log=tmp / f"{impl}.log", deadline_s=DEADLINE_S,
    )  # fmt: skip
    return launch, read_records(str(out))


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, list[dict]]:
    return _run(tmp_path_factory.mktemp("ours"), "ours", OURS)


def _same_error_everywhere(ranks: list[dict], scenario: str, error: str) -> str:
    results = [r[scenario] for r in ranks]
    assert [r["error"] for r in results] == [error, error], results
    assert results[0]["message"] == results[1]["message"]
    assert all(r["seconds"] < WITHIN_S for r in results), results
    return results[0]["message"]


def test_ours_job_finishes(ours: tuple[Launch, list[dict]]) -> None:
    launch, ranks = ours
    assert launch.returncode is not None, f"hung:\n{launch.output[-4000:]}"
    assert all(set(r) == set(OURS.split(",")) for r in ranks), launch.output[-4000:]


def test_skipped_block_names_what_each_rank_issues(ours) -> None:
    message = _same_error_everywhere(ours[1], "skip_block", "CollectiveMismatchError")
    # Numbered from the diverging step on, where the job set the check's short timeout.
    assert "rank 0: all_gather #2 of 'blocks.1' in forward (2,688 B)" in message
    assert "rank 1: all_gather #2 of 'blocks.2' in forward (3,216 B)" in message
    assert "same fully_shard modules in the same order" in message


def test_skipped_block_of_the_same_size_is_caught(ours) -> None:
    # Equal sizes: without the check the all-gather would swap weights silently.
    message = _same_error_everywhere(ours[1], "skip_same_size", "CollectiveMismatchError")
    assert "'blocks.1' in forward (2,688 B)" in message
    assert "'blocks.2' in forward (2,688 B)" in message


def test_unused_param_suggests_the_fix(ours) -> None:
    message = _same_error_everywhere(ours[1], "unused_param", "CollectiveMismatchError")
    assert "rank 0: reduce_scatter #8 of 'blocks.1' in backward (5,376 B)" in message
    assert "rank 1: reduce_scatter #8 of 'blocks.1' in backward (4,288 B)" in message
    assert "set_reduce_scatter_unused_params(True)" in message
    fixed = [r["unused_param_fixed"] for r in ours[1]]
    assert all(r["error"] is None and r["finite"] and len(r["losses"]) == 2 for r in fixed)


def test_nonfinite_gradient_names_rank_and_parameter(ours) -> None:
    message = _same_error_everywhere(ours[1], "nan", "NonFiniteGradError")
    assert "in 'blocks.2' before its reduce-scatter" in message
    assert "rank 1: blocks.2.up.weight" in message and "rank 0:" not in message


def test_stalled_rank_times_out_the_others(ours) -> None:
    waiting, stalled = (r["stalls"] for r in ours[1])
    assert waiting["error"] == "CollectiveMismatchError"
    assert f"waited {CHECK_TIMEOUT_S:g} s for the other ranks" in waiting["message"]
    assert CHECK_TIMEOUT_S <= waiting["seconds"] < CHECK_TIMEOUT_S + WITHIN_S
    assert stalled["error"] is None


@pytest.mark.parametrize("impl", ["torch", "ours_unchecked"])
def test_without_checks_nan_spreads_and_divergence_aborts(tmp_path: Path, impl: str) -> None:
    # nan first: the abort of skip_block ends the job.
    launch, ranks = _run(tmp_path, impl, "nan,skip_block")
    assert launch.returncode is not None, f"hung:\n{launch.output[-4000:]}"
    nan = [r["nan"] for r in ranks]
    # No error anywhere, and rank 1's NaN reached rank 0's parameters too.
    assert all(r["error"] is None and not r["finite"] for r in nan), nan
    assert launch.returncode != 0
    assert "SIGABRT" in launch.output or "exitcode  : -6" in launch.output, launch.output[-4000:]
