"""FSDP's Python work per parameter, against torch's ``fully_shard`` in the same process
(issue 20, part 3; ``benchmarks/bench_host.py`` reports the figures).

Counted with cProfile (every Python call, torch's DTensor and autograd code included)
over one forward + backward on torch's fake process group, where no collective
communicates: deterministic, no timing. Many small parameters (groups of 4
``Linear(8, 8)``), so the per-parameter work dominates the per-group work.
"""

import cProfile
import pstats

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import MixedPrecisionPolicy, fully_shard
from tests._harness import fake_mesh

GROUPS, PER_GROUP = 6, 4


def _calls_per_param(shard, policy, mesh) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(*(nn.Linear(8, 8) for _ in range(PER_GROUP))) for _ in range(GROUPS))
    )
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for group in model:
        shard(group, **kwargs)
    shard(model, **kwargs)
    x = torch.randn(2, 8)
    for _ in range(2):  # lazy init and first-use caches are not per-step work
        model(x).sum().backward()
    for param in model.parameters():
        param.grad = None  # every step lands new sharded grads, as after zero_grad()
    profiler = cProfile.Profile()
    profiler.enable()
    model(x).sum().backward()
    profiler.disable()
    return pstats.Stats(profiler).total_calls / (2 * GROUPS * PER_GROUP)


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
def test_python_calls_per_parameter_at_most_torchs(mixed_precision: bool) -> None:
    with fake_mesh(2) as mesh:
        ours = _calls_per_param(
            fully_shard,
            MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else None,
            mesh,
        )
        theirs = _calls_per_param(
            torch_fully_shard,
            TorchMixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else None,
            mesh,
        )
    # Issue 20 targets 0.7x (met: ~0.6x here on torch 2.13); the test asks only for no
    # more than torch's, as torch's own count moves between versions.
    assert ours <= theirs, (
        f"ours {ours:.1f} Python calls per parameter per step, torch {theirs:.1f}"
    )
