"""Launch a script under ``torchrun`` on local ranks, bounded by a deadline.

Loopback c10d rendezvous on a free port, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with
``--max-restarts``, torch 2.13's restarted workers can otherwise read the dead group's
addresses from the shared rendezvous store and hang, or fail to connect), its own
process group so a kill at the deadline reaches every worker. Verdicts should rest on
what the workers wrote, not on exit codes alone (gloo may abort at exit after the work
is done). Only ``full`` tests launch jobs (tests/conftest.py).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests._harness import require_full

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Launch:
    """What one torchrun launch left behind."""

    returncode: int | None  # None: killed at the deadline
    output: str  # the launcher's and every worker's stdout and stderr
    elapsed_s: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(
    script: Path, *args: str, log: Path, nproc: int = 2, deadline_s: float = 60.0,
    max_restarts: int = 0, monitor_interval_s: float = 0.5, share_store: bool = False,
) -> Launch:  # fmt: skip
    require_full("launches torchrun")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--monitor-interval", str(monitor_interval_s), str(script), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        # The workers' store lives in rank 0, unless shared (the launcher's own).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    return Launch(returncode, log.read_text(), time.monotonic() - start)
