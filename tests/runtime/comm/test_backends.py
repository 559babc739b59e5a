"""The reduce-scatter is chosen by the backend serving the gradients' device, never by
the backend's name, and every branch of ``collectives.py`` runs on CPU.

Branches: all-to-all + local sum (gloo), ``reduce_scatter_tensor`` with SUM (any other
backend; torch's threaded group in ``test_threaded_pg.py``) and ``reduce_scatter_tensor``
with AVG (NCCL; forced here on gloo, which implements AVG too), and HSDP's all-reduce
with SUM or AVG.

One spawn of 2 gloo ranks runs every scenario. The backend-string scenarios tear the
harness's ``"gloo"`` default group down and build it again with
``init_process_group(backend="cpu:gloo")`` and with no backend at all (``"undefined"``),
then train a 3-group MLP with our ``fully_shard`` and torch's on the same data.
"""

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.runtime.collectives import all_reduce, finish_reduce_scatter, reduce_scatter
from dtensor_fsdp.runtime.comm_description import ReductionOps
from dtensor_fsdp.runtime.comm_math import copy_in_grads
from dtensor_fsdp.runtime.comm_strategies import DefaultReduceScatter
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import local_pairs, make_optimizer
from tests._pool import GlooPools

WORLD_SIZE = 2
STEPS = 3
CPU = torch.device("cpu")

# Each rank's grads: two tensors of 3 and 5 rows (uneven over 2 ranks: padded).
SHAPES = ((3, 2), (5,))


def _rank_grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _expected_chunk(rank: int, world_size: int) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of every grad, padded as FSDP pads."""
    total = [sum(parts) for parts in zip(*(_rank_grads(r) for r in range(world_size)))]
    chunks = []
    for grad in total:
        rows = -(-grad.shape[0] // world_size)  # ceil
        padded = torch.zeros((rows * world_size, *grad.shape[1:]))
        padded[: grad.shape[0]] = grad
        chunks.append(padded.chunk(world_size)[rank].reshape(-1))
    return torch.cat(chunks)


def _reduce(ops: ReductionOps) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reduce_input = copy_in_grads(_rank_grads(rank), torch.float32, world_size)
    result = reduce_scatter(
        reduce_input, dist.group.WORLD, ops, DefaultReduceScatter(), async_op=True
    )
    if result.work is not None:
        result.work.wait()
    return {"got": finish_reduce_scatter(result), "sum": _expected_chunk(rank, world_size)}


def _all_reduce(average: bool) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = _rank_grads(rank)[1].clone()
    all_reduce(tensor, dist.group.WORLD, average)
    total = sum(_rank_grads(r)[1] for r in range(world_size))
    return {"got": tensor, "expected": total / world_size if average else total}


def _train_vs_torch(mesh: Any) -> dict:
    """Our fully_shard and torch's on the same 3-group MLP and data."""
    base = mlp()
    ours = shard_mlp(copy.deepcopy(base), mesh)
    theirs = shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard)
    opts = make_optimizer(ours.parameters()), make_optimizer(theirs.parameters())
    records = []
    for step in range(STEPS):
        torch.manual_seed(10 * step + dist.get_rank())
        x = torch.randn(4, 8)
        losses = [m(x).pow(2).mean() for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        rec = {"loss": tuple(loss.item() for loss in losses)}
        rec["grads"] = local_pairs(ours, theirs, grads=True)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        rec["params"] = local_pairs(ours, theirs, grads=False)
        records.append(rec)
    return {"steps": records}


def _with_backend(store_dir: str, name: str, backend: str | None) -> dict:
    """Rebuild the default group with ``backend`` (None: no argument), then check the
    reduction ops and train against torch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, name), world_size)
    kwargs = {} if backend is None else {"backend": backend}
    dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)
    mesh = init_device_mesh("cpu", (world_size,))
    ops = ReductionOps.choose(mesh.get_group(0), None, CPU, prefer_average=True, custom=None)
    # fully_shard without a mesh builds one over the default group, on its device.
    default_layouts = [
        {
            name: (p.device_mesh.device_type, p.device_mesh.size(), tuple(p.placements))
            for name, p in shard(mlp()).named_parameters()
        }
        for shard in (fully_shard, torch_fully_shard)
    ]
    return {
        "backend": dist.get_backend(),
        "ops": ops,
        "default_mesh_layouts": default_layouts,
        **_train_vs_torch(mesh),
    }


def _worker(rank: int, world_size: int, store_dir: str) -> dict:
    group = dist.group.WORLD
    ops_cases = {
        "all_to_all_sum": ReductionOps(use_all_to_all=True, average_in_reduce_scatter=False),
        "reduce_scatter_sum": ReductionOps(use_all_to_all=False, average_in_reduce_scatter=False),
        "reduce_scatter_avg": ReductionOps(use_all_to_all=False, average_in_reduce_scatter=True),
    }
    scenarios = {name: (lambda ops=ops: _reduce(ops)) for name, ops in ops_cases.items()}
    scenarios |= {
        "all_reduce_sum": lambda: _all_reduce(False),
        "all_reduce_avg": lambda: _all_reduce(True),
        "gloo_ops": lambda: ReductionOps.choose(
            group, group, CPU, prefer_average=True, custom=None
        ),
        # Last: they replace the default group.
        "cpu_gloo": lambda: _with_backend(store_dir, "cpu_gloo", "cpu:gloo"),
        "undefined": lambda: _with_backend(store_dir, "undefined", None),
    }
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list[dict]:
    store_dir = str(tmp_path_factory.mktemp("backend_stores"))
    return run_distributed(_worker, WORLD_SIZE, store_dir, timeout=180, pool=gloo_pool)


@pytest.mark.parametrize(
    "name,divisor",
    [("all_to_all_sum", 1), ("reduce_scatter_sum", 1), ("reduce_scatter_avg", WORLD_SIZE)],
)
def test_every_reduce_scatter_branch_on_gloo(run, name: str, divisor: int) -> None:
    for rank, rec in enumerate(scenario_records(run, name)):
        # Sums of 2 addends are exact in any order; gloo's AVG divides by 2 (exact).
        expected = rec["sum"] / divisor
        torch.testing.assert_close(rec["got"], expected, atol=0, rtol=0, msg=f"rank {rank}")


@pytest.mark.parametrize("name", ["all_reduce_sum", "all_reduce_avg"])
def test_hsdp_all_reduce_sum_and_avg_on_gloo(run, name: str) -> None:
    for rank, rec in enumerate(scenario_records(run, name)):
        torch.testing.assert_close(rec["got"], rec["expected"], atol=0, rtol=0, msg=f"rank {rank}")


def test_gloo_takes_all_to_all_and_no_avg(run) -> None:
    for ops in scenario_records(run, "gloo_ops"):
        assert ops == ReductionOps(
            use_all_to_all=True, average_in_reduce_scatter=False, average_in_all_reduce=False
        )


@pytest.mark.parametrize("name,backend", [("cpu_gloo", "cpu:gloo"), ("undefined", "undefined")])
def test_backend_string_other_than_gloo_still_picks_gloos_plan(run, name: str, backend: str):
    for rank, rec in enumerate(scenario_records(run, name)):
        assert rec["backend"] == backend, f"rank {rank}: not the backend string under test"
        assert rec["ops"].use_all_to_all and not rec["ops"].average_in_reduce_scatter
        ours, theirs = rec["default_mesh_layouts"]
        assert ours == theirs, f"rank {rank}: fully_shard(model) without a mesh"
        assert {layout[:2] for layout in ours.values()} == {("cpu", WORLD_SIZE)}
        for step, step_rec in enumerate(rec["steps"]):
            where = f"rank {rank} step {step}"
            ours, theirs = step_rec["loss"]
            # Same forward arithmetic; grads differ only in how 2 addends are summed
            # (exact either way) before the same division by 2.
            assert ours == theirs, where
            for kind in ("grads", "params"):
                for fqn, (a, b) in step_rec[kind].items():
                    assert torch.equal(a, b), f"{where} {kind} {fqn}"
