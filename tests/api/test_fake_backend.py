"""Importing dtensor_fsdp registers what importing torch's FSDP registers and FSDP users
rely on: the ``"fake"`` c10d backend, which torchtitan gives size-1 mesh axes (a
``new_group`` with that backend; ``init_process_group("fake")`` imports it itself).
Each case runs in a fresh interpreter, so nothing the test session imported leaks in."""

import subprocess
import sys

import pytest

SCRIPT = """
import torch.distributed as dist
{imports}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.new_group([0], backend="fake")
print("ok")
"""


def _run(imports: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(imports=imports)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "imports", ["import torch.distributed.fsdp", "import dtensor_fsdp"], ids=["torch", "ours"]
)
def test_fake_backend_is_registered_by_the_fsdp_import(imports):
    result = _run(imports)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_without_an_fsdp_import_the_fake_backend_is_unknown():
    """The control: the tests above pass by the import's side effect."""
    result = _run("")
    assert result.returncode != 0
    assert "Unknown c10d backend type FAKE" in result.stderr, result.stderr[-2000:]
