"""The collective watchdog sees graph mode: a rank that diverges or dies inside a
compiled step ends every surviving rank in ``CollectiveMismatchError``, as in eager
mode, within the deadline, with dtensor_fsdp's defaults on 2 gloo ranks but a 3 s
deadline (the default's 60 s would only wait longer: the eager tests in
tests/observe/test_watchdog.py shorten it too).

Each launch runs ``tests/graph/_graph_fault_job.py`` under ``torchrun`` (killed past the
launch deadline). As in ``tests/observe/test_watchdog.py``, the launcher shares its own
store with the workers (so it outlives a worker gloo killed) and its monitor interval is
long (the agent stops the other workers at its first look after one died, which may
come at any moment of the interval), so that it does not stop the survivors before
they report: the survivor reports within ``WITHIN_S`` of the death (which comes at the
start of the second step or later), so a monitor interval of ``WITHIN_S`` never stops it
first.
"""

from pathlib import Path

import pytest

from tests._torchrun import torchrun
from tests.observe._divergence_job import read_records

JOB = Path(__file__).with_name("_graph_fault_job.py")
LAUNCH_DEADLINE_S = 420.0  # compiles on a loaded 2-core machine, the fault, a monitor tick
DEADLINE_S = 3.0  # the watchdog's
# From the start of the second step: the deadline, the answer timeout for a rank that
# died (the deadline again), and room for a recompile on a loaded machine (skip_block
# retraces rank 1's forward); far below gloo's own timeout (30 min), which is what a
# survivor would wait without the watchdog.
WITHIN_S = 30.0


@pytest.mark.parametrize("scenario", ["skip_block", "dies"])
def test_survivor_ends_in_the_named_error(tmp_path: Path, scenario: str) -> None:
    out = tmp_path / scenario
    launch = torchrun(
        JOB, "--scenario", scenario, "--out", str(out), "--deadline", str(DEADLINE_S),
        log=tmp_path / "job.log", deadline_s=LAUNCH_DEADLINE_S, monitor_interval_s=WITHIN_S,
        share_store=True,
    )  # fmt: skip
    assert launch.returncode is not None, f"hung:\n{launch.output[-4000:]}"
    ranks = read_records(str(out))
    survivors = [r for r in ranks if r]
    assert survivors, launch.output[-4000:]
    for result in survivors:
        print(f"{scenario}: the survivor raised {result['error']} after {result['seconds']:.1f} s")
        assert result["error"] == "CollectiveMismatchError", (result, launch.output[-4000:])
        assert result["seconds"] < WITHIN_S, result
        assert "stopped answering" in result["message"], result["message"]
        # The records the survivor published name its compiled graph's collectives.
        assert "all_gather" in result["message"], result["message"]
