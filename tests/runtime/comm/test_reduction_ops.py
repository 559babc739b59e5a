"""Which reduce-scatter and which ``ReduceOp`` a group's gradients get, by the backend
that serves their device: the decisions that need NCCL, on torch's fake group.

No NCCL here (CPU build, no GPU), so the fake group's backend class stands in for
``ProcessGroupNCCL``; the branches themselves run on gloo and on torch's threaded group
in ``tests/runtime/comm/test_backends.py`` and ``tests/runtime/scenarios/test_threaded_pg.py``.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from dtensor_fsdp.runtime.comm_description import ReductionOps, gradient_divisors
from dtensor_fsdp.runtime.mesh import backend_for, mesh_info_for
from tests._harness import fake_mesh

CPU = torch.device("cpu")


@pytest.fixture
def nccl_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the fake group's backend count as NCCL for the duration of a test."""
    with fake_mesh(1):
        fake_backend = type(backend_for(dist.group.WORLD, CPU))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", fake_backend, raising=False)


def _groups(shape: tuple[int, int]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    mesh = DeviceMesh("cpu", torch.arange(shape[0] * shape[1]).view(shape))
    return mesh.get_group(1), mesh.get_group(0)  # (shard, replicate)


@pytest.mark.parametrize(
    "shape,reduce_scatter_avg,all_reduce_avg",
    [
        ((2, 2), True, True),
        ((4, 1), False, True),  # a one-rank shard group: NCCL's AVG can be wrong there
        ((1, 4), True, False),  # a one-rank replicate group
    ],
)
def test_avg_on_nccl_only_over_more_than_one_rank(
    nccl_like: None, shape: tuple[int, int], reduce_scatter_avg: bool, all_reduce_avg: bool
) -> None:
    with fake_mesh(4):
        shard, replicate = _groups(shape)
        ops = ReductionOps.choose(shard, replicate, CPU, prefer_average=True, custom=None)
        assert ops == ReductionOps(
            use_all_to_all=False,
            average_in_reduce_scatter=reduce_scatter_avg,
            average_in_all_reduce=all_reduce_avg,
        )
        # A custom divide factor, fp16 or force-sum turn prefer_average off: SUM only.
        ops = ReductionOps.choose(shard, replicate, CPU, prefer_average=False, custom=None)
        assert not ops.average_in_reduce_scatter and not ops.average_in_all_reduce


def test_backend_that_is_neither_gloo_nor_nccl_gets_reduce_scatter_with_sum() -> None:
    with fake_mesh(4):
        shard, replicate = _groups((2, 2))
        ops = ReductionOps.choose(shard, replicate, CPU, prefer_average=True, custom=None)
    assert ops == ReductionOps(use_all_to_all=False, average_in_reduce_scatter=False)


@pytest.mark.parametrize(
    "ops,divisor",
    [
        (ReductionOps(False, average_in_reduce_scatter=False), 4.0),
        (ReductionOps(False, average_in_reduce_scatter=True, average_in_all_reduce=True), 1.0),
        # Each axis that does not average in its collective is divided for afterwards.
        (ReductionOps(False, average_in_reduce_scatter=True), 2.0),
        (ReductionOps(False, average_in_reduce_scatter=False, average_in_all_reduce=True), 2.0),
    ],
)
def test_divisor_covers_the_axes_the_collectives_do_not_average(
    ops: ReductionOps, divisor: float
) -> None:
    with fake_mesh(4):
        # HSDP: 2 replicas x 2 shards
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))
        info = mesh_info_for(mesh)
        sizes = (None, info.shard_size, info.replicate_size)
        assert gradient_divisors(ops, torch.float32, *sizes) == (1.0, divisor)
        # fp16 splits the divisor around the sum exactly as torch's FSDP2 does.
        pre, post, _, _ = _get_gradient_divide_factors(None, None, torch.float16, factor=divisor)
        assert gradient_divisors(ops, torch.float16, *sizes) == (pre, post)
