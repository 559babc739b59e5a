"""``import dtensor_fsdp`` leaves what only some jobs use unimported, in a fresh
interpreter (so nothing the test session imported leaks in):

- ``torch.distributed.pipelining``: the adapter for torch's pipeline schedules
  (``dtensor_fsdp.pipelining``) imports it, and is imported only where a pipeline is
  built;
- graph mode's compiler: AOTAutograd and its partitioner (which imports networkx) load
  at the first ``dtensor_fsdp.compile``, not with the package (~0.3 s of CPU in every
  process, a test's ranks included).

Each check has its control: the import that should bring the module in, seen to.
"""

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import dtensor_fsdp
def imported():
    return ["torch.distributed.pipelining" in sys.modules,
            "torch._functorch.partitioners" in sys.modules]
print(*imported())
import dtensor_fsdp.pipelining
import dtensor_fsdp.graph.backend
print(*imported())
"""


@pytest.fixture(scope="module")
def imported() -> list[list[str]]:
    """Per module checked: imported after ``import dtensor_fsdp``, then after its control."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [list(pair) for pair in zip(*(line.split() for line in result.stdout.splitlines()))]


def test_import_dtensor_fsdp_leaves_pipelining_unimported(imported):
    assert imported[0] == ["False", "True"]


def test_import_dtensor_fsdp_leaves_the_graph_compiler_unimported(imported):
    assert imported[1] == ["False", "True"]
