"""Multi-node HSDP for real: two ``torchrun`` launches on loopback play two nodes.

Each "node" runs 2 processes of ``train.py --replicate 2``: the mesh is (replicate=2,
shard=2), torchrun gives each node consecutive global ranks, so parameters are sharded
within a node and replicated across the two. The launches meet through a c10d
rendezvous on a free port, exactly as on a cluster (``--nnodes 2 --node-rank R
--rdzv-backend c10d --rdzv-endpoint HOST:PORT``). Global rank 0 writes the per-step
losses, grad norms and final full parameters (``--metrics-out``), which must match a
single process training ``train.py``'s model on the same global batches.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` keeps the workers off the launcher's
rendezvous store: with it shared, torch 2.13's restarted workers can read the dead
group's addresses from it and hang, or fail to connect. The launches run in their own process groups and are killed, with
all their workers, if they outlast the deadline; the verdict rests on the metrics
file, not on exit codes (gloo may abort at interpreter exit after the work is done).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from dtensor_fsdp.models.llama import Llama
from tests._parity import adamw_param_atol

REPO = Path(__file__).resolve().parents[2]
NODES, PROCS_PER_NODE = 2, 2
DEADLINE_S = 75.0
FLAGS = (
    "--device cpu --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --vocab-size 64 "
    f"--seq-len 16 --batch-size 2 --steps 3 --replicate {NODES}"
).split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(node_rank: int, port: int, metrics: Path, log: Path) -> subprocess.Popen:
    torchrun = (
        f"-m torch.distributed.run --nnodes {NODES} --node-rank {node_rank} "
        f"--nproc-per-node {PROCS_PER_NODE} --rdzv-backend c10d "
        f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-conf join_timeout=45 --local-addr 127.0.0.1"
    ).split()
    command = [sys.executable, *torchrun, "train.py", *FLAGS, "--metrics-out", str(metrics)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killpg reaches its workers
        )


def _run_two_nodes(tmp_path: Path) -> dict:
    metrics, port = tmp_path / "metrics.json", _free_port()
    logs = [tmp_path / f"node{r}.log" for r in range(NODES)]
    nodes = [_launch(r, port, metrics, logs[r]) for r in range(NODES)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        for node in nodes:
            node.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [r for r, node in enumerate(nodes) if node.poll() is None]
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    tails = "\n".join(
        f"--- node {r} (exit {n.returncode}):\n{logs[r].read_text()[-3000:]}"
        for r, n in enumerate(nodes)
    )
    if hung:
        pytest.fail(f"nodes {hung} still running after {DEADLINE_S:.0f}s, killed:\n{tails}")
    if not metrics.exists():
        pytest.fail(f"rank 0 wrote no metrics:\n{tails}")
    return {"metrics": json.loads(metrics.read_text()), "logs": tails}


def _reference() -> dict:
    """train.py's model, optimizer and data, in one process on the global batch."""
    args = train.parse_args(FLAGS)
    config = train.build_config(args)
    model = Llama(config)
    train.init_from_seed(model, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    generator = torch.Generator().manual_seed(args.seed)
    losses, norms = [], []
    for _ in range(args.steps):
        rows = args.batch_size * NODES * PROCS_PER_NODE  # every rank is a data-parallel rank
        tokens = train.synthetic_batch(generator, rows, config.max_seq_len, config.vocab_size)
        loss, norm = train.train_step(model, [optimizer], tokens, args)
        losses.append(loss.item())
        norms.append(norm.item())
    params = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params}


def test_hsdp_across_two_nodes_matches_single_process(tmp_path: Path) -> None:
    run = _run_two_nodes(tmp_path)
    ours, ref = run["metrics"], _reference()
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-5), run["logs"]
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), run["logs"]
    assert sorted(ours["params"]) == sorted(ref["params"])
    for name, values in ref["params"].items():
        torch.testing.assert_close(
            torch.tensor(ours["params"][name]),
            torch.tensor(values),
            # AdamW: see [Note: parity tolerances] in _parity.py, item 3.
            atol=adamw_param_atol(len(ref["losses"]), lr=train.parse_args(FLAGS).lr),
            rtol=1e-5,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    assert "mesh DeviceMesh((replicate=2, shard=2)" in run["logs"], run["logs"]
