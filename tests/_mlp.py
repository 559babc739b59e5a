"""The 3-group MLP that the schedule and feature tests share: two blocks and the root.

Linear(8, 16) and Linear(16, 16) are blocks 0 and 2; the root keeps Linear(16, 3).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from dtensor_fsdp import fully_shard


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def shard_mlp(
    model: nn.Sequential, mesh: Any, shard: Callable[..., Any] = fully_shard, **kwargs: Any
) -> nn.Sequential:
    """``shard`` (ours or torch's fully_shard) on each block, then on the root."""
    for block in (model[0], model[2]):
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model
