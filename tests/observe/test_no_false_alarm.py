"""Healthy jobs that FSDP's default checks (the collective watchdog, the optimizer step
guard) must not stop, under ``torchrun``: ours against torch's ``fully_shard`` on the
same script (``tests/observe/_false_alarm_job.py``), each must give torch's result and
raise nothing.

- ``dcgan``: one Adam over a GAN's two models steps for the discriminator while the
  generator's forward awaits its backward (the step guard once flagged it).
- ``gil_hold``: with a 2 s deadline rank 0 holds the GIL for at least 6 s (three
  deadlines) in one C call between its backward and its optimizer step, so that its
  watchdog thread cannot answer rank 1's comparisons (the watchdog once declared it
  dead): warnings at most.
- ``late_waits``: rank 0 starts every step and every block's forward 0-3 ms late and
  ours waits in 1 ms slices until 10,000 waits outlasted their slice (a collective that
  completed right after a slice ran out once read as failed); torch's run trains the
  first 200 of its steps, to compare with.

``dcgan`` and ``late_waits`` run ours' defaults (the watchdog's deadline too: a 2 s one
would also warn, rightly, when a loaded machine stalls a rank that long).

A divergence and a rank gloo killed still end in a named error within the deadline:
test_watchdog.py.
"""

from pathlib import Path

import pytest

from tests._torchrun import Launch, torchrun
from tests.observe._divergence_job import read_records
from tests.observe._false_alarm_job import COMPARED_STEPS

JOB = Path(__file__).with_name("_false_alarm_job.py")
SCENARIOS = "dcgan,gil_hold,late_waits"
DEADLINE_S = 2.0  # ours' watchdog's, in gil_hold
HOLD_S = 3 * DEADLINE_S
LATE_WAITS = 10_000
LAUNCH_DEADLINE_S = 600.0  # about 90 s for ours on two loaded cores


def _launch(tmp: Path, impl: str, *args: str) -> tuple[Launch, list[dict]]:
    out = tmp / impl
    launch = torchrun(
        JOB, "--impl", impl, "--scenarios", SCENARIOS, "--deadline", str(DEADLINE_S),
        "--hold-s", str(HOLD_S), "--out", str(out), *args,
        log=tmp / f"{impl}.log", deadline_s=LAUNCH_DEADLINE_S,
    )  # fmt: skip
    ranks = read_records(str(out))
    assert all(set(r) == set(SCENARIOS.split(",")) for r in ranks), launch.output[-4000:]
    return launch, ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("no_false_alarm")
    _, ours = _launch(tmp, "ours", "--until-stalls", str(LATE_WAITS), "--steps", "100000")
    _, theirs = _launch(tmp, "torch", "--steps", str(COMPARED_STEPS))
    return {"ours": ours, "torch": theirs}


def _same_result_no_error(runs: dict[str, list[dict]], scenario: str) -> list[dict]:
    ours = [rank[scenario] for rank in runs["ours"]]
    theirs = [rank[scenario] for rank in runs["torch"]]
    for rank, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert reference["error"] is None, (rank, reference)
        assert mine["error"] is None, (rank, mine)
        # The checks change no arithmetic: bitwise torch's (late_waits: over torch's
        # `COMPARED_STEPS`; ours trains on until it counted its late waits).
        if scenario == "late_waits":
            assert len(reference["losses"]) == COMPARED_STEPS, rank
            assert mine["losses"][:COMPARED_STEPS] == reference["losses"], rank
            assert mine["digest_compared"] == reference["digest"], rank
        else:
            assert mine["losses"] == reference["losses"], rank
            assert mine["digest"] == reference["digest"], rank
    return ours


def test_a_gan_step_while_the_generator_awaits_its_backward(runs) -> None:
    ours = _same_result_no_error(runs, "dcgan")
    assert [r["warnings"] for r in ours] == [[], []]


def test_a_rank_holding_the_gil_three_deadlines_draws_warnings_only(runs) -> None:
    ours = _same_result_no_error(runs, "gil_hold")
    assert ours[0]["held_s"] >= HOLD_S, ours[0]["held_s"]
    # Rank 1 compared while rank 0 held the GIL: it named rank 0, and waited on.
    silent = [w for w in ours[1]["warnings"] if "gave no answer" in w]
    assert silent and all(
        w.startswith("FSDP straggler: rank(s) [0] gave no answer") for w in silent
    )
    for rank in ours:
        assert all(
            w.startswith(("FSDP straggler", "FSDP collective slow")) for w in rank["warnings"]
        )


def test_waits_that_outlast_a_1_ms_slice_complete(runs) -> None:
    ours = _same_result_no_error(runs, "late_waits")
    assert sum(r["stalls"] for r in ours) >= LATE_WAITS, [r["stalls"] for r in ours]
    assert [r["warnings"] for r in ours] == [[], []]
    # Every stalled wait published its records: one key per rank, overwritten.
    for rank in ours:
        after_200_steps, at_the_end = rank["resources"]
        assert after_200_steps == at_the_end, rank["resources"]  # (threads, store keys)
