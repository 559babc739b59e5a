"""What several benchmarks share, one module a job; a benchmark script imports it as
``common.<module>`` (``benchmarks/`` is the script's own folder, first on ``sys.path``).

- ``dist.py``: torchrun's process group in and out, the slowest rank's time of a call,
  reductions across ranks on the group's device;
- ``device.py``: CUDA syncs and cuBLAS's workspaces paid before measuring;
- ``tensor_memory.py``: MemTracker's peak of a step (live tensor bytes);
- ``rss.py``: the host's peak resident set around a call;
- ``comms.py``: recorded collectives summed per kind, ring wire bytes;
- ``workload.py``: the Llama's FSDP groups (blocks, then the root), each rank's tokens;
- ``stats.py``: percentiles of step times;
- ``spawn.py``: W gloo ranks from a plain ``python`` script.

Collectives are recorded with ``tests/_c10d.py``'s ``C10dRecorder`` (the tests' ruler).
"""

import sys
from pathlib import Path

# The repository root, for ``tests._c10d`` and this checkout's ``dtensor_fsdp``: a script
# run as ``torchrun benchmarks/x.py`` has only its own folder on sys.path.
_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.insert(1, _REPO)
