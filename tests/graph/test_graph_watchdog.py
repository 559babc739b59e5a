"""The collective watchdog sees graph mode: a rank that diverges or dies inside a
compiled step ends every surviving rank in ``CollectiveMismatchError``, as in eager
mode, within the default deadline (60 s), with dtensor_fsdp's defaults on 2 gloo ranks.

Each launch runs ``tests/graph/_graph_fault_job.py`` under ``torchrun`` (killed past the
launch deadline). As in ``tests/observe/test_watchdog.py``, the launcher shares its own
store with the workers (so it outlives a worker gloo killed) and its monitor interval is
long (the agent stops the other workers at its first look after one died, which may
come at any moment of the interval), so that it does not stop the survivors before
they report.
"""

from pathlib import Path

import pytest

from tests._torchrun import torchrun
from tests.observe._divergence_job import read_records

JOB = Path(__file__).with_name("_graph_fault_job.py")
LAUNCH_DEADLINE_S = 420.0  # compiles on a loaded 2-core machine, the fault, a monitor tick
WITHIN_S = 70.0  # the default deadline (60 s) and room


@pytest.mark.parametrize("scenario", ["skip_block", "dies"])
def test_survivor_ends_in_the_named_error(tmp_path: Path, scenario: str) -> None:
    out = tmp_path / scenario
    launch = torchrun(
        JOB, "--scenario", scenario, "--out", str(out),
        log=tmp_path / "job.log", deadline_s=LAUNCH_DEADLINE_S, monitor_interval_s=90.0,
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
