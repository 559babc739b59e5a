"""``fully_shard(module)`` with no mesh and no process group yet: like torch's, it
initializes the default process group from the environment (``env://``, what torchrun
sets up) and shards over all of it. Each implementation runs in its own fresh
interpreter, as one rank of a world of one."""

import json
import os
import socket
import subprocess
import sys

from torch.distributed.tensor import Shard

_CHILD = """
import json, sys
import torch, torch.distributed as dist
from torch import nn
if sys.argv[1] == "torch":
    from torch.distributed.fsdp import fully_shard
else:
    from dtensor_fsdp import fully_shard
model = nn.Linear(4, 4)
fully_shard(model)
weight = model.weight
print(json.dumps({
    "initialized": dist.is_initialized(),
    "world_size": dist.get_world_size(),
    "mesh": [weight.device_mesh.device_type, list(weight.device_mesh.shape)],
    "placements": [str(p) for p in weight.placements],
    "local_shape": list(weight.to_local().shape),
}))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(impl: str) -> dict:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, impl], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_process_group_yet_initializes_the_default_one_like_torch() -> None:
    ours, theirs = _run("ours"), _run("torch")
    assert theirs == {
        "initialized": True,
        "world_size": 1,
        "mesh": ["cpu", [1]],
        "placements": [str(Shard(0))],
        "local_shape": [4, 4],
    }
    assert ours == theirs
