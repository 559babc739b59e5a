"""``import dtensor_fsdp`` does not import ``torch.distributed.pipelining``: the adapter
for torch's pipeline schedules (``dtensor_fsdp.pipelining``) imports it, and is imported
only where a pipeline is built. A fresh interpreter, so nothing the test session
imported leaks in."""

import subprocess
import sys

SCRIPT = """
import sys
import dtensor_fsdp
print("torch.distributed.pipelining" in sys.modules)
import dtensor_fsdp.pipelining
print("torch.distributed.pipelining" in sys.modules)
"""


def test_import_dtensor_fsdp_leaves_pipelining_unimported():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # The second line is the control: the check sees the import when it happens.
    assert result.stdout.split() == ["False", "True"], result.stdout
