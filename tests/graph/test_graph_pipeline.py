"""Pipeline parallelism with graph-mode stages: torch's schedules drive stage modules
compiled by ``dtensor_fsdp.compile`` (``aot_eager``) as they drive eager ones, bitwise.

pp=2 x dp=2 on 4 gloo ranks, the stages of ``tests/integrations/test_pipeline.py``
(each a root over two blocks), 4 microbatches, 2 steps (the first also runs the
stages' metadata inference). Graph mode reads ``set_requires_gradient_sync`` at the
forward, so ``dtensor_fsdp.pipelining.PipelineStage`` turns it off before every
microbatch's forward; the step's ``perform_reduce_grad`` reduces the accumulated sums
once per group (``FSDPModule.run_post_backward``, graph/pending.py), as for an eager
stage. Per step: losses, local sharded grads and, after an SGD step, local shards,
against the same stages in eager mode.
"""

import copy
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dtensor_fsdp
from dtensor_fsdp import fully_shard
from dtensor_fsdp.pipelining import PipelineStage, register_fsdp_actions
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests.integrations.test_pipeline import (
    BATCH,
    DIM,
    DP,
    MICROBATCHES,
    MULTI_STAGE,
    PP,
    SCHEDULES,
    StageModule,
    _local_modules,
    _loss,
    _shard,
    _step,
)

STEPS = 2
# One stage per rank, and a runtime schedule with several (UNSHARD/RESHARD actions).
CASES = ("gpipe", "1f1b", "interleaved1f1b")


def _build(graph: bool, modules: dict[int, StageModule], mesh: DeviceMesh, schedule: str):
    stages = []
    for index, module in modules.items():
        module = copy.deepcopy(module)
        _shard(module, fully_shard, mesh["dp"], True)
        if graph:
            dtensor_fsdp.compile(module, backend="aot_eager")
        stages.append(
            PipelineStage(
                module, index, PP * len(modules), torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    if schedule in MULTI_STAGE:
        return register_fsdp_actions(SCHEDULES[schedule](stages, MICROBATCHES, loss_fn=_loss)), stages
    return SCHEDULES[schedule](stages[0], MICROBATCHES, loss_fn=_loss), stages


def _pipeline(mesh: DeviceMesh, schedule: str) -> dict[str, Any]:
    torch._dynamo.reset()
    modules = _local_modules(mesh, schedule)
    built = {mode: _build(mode == "graph", modules, mesh, schedule) for mode in ("eager", "graph")}
    optimizers = {
        mode: torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
        for mode, (_, stages) in built.items()
    }
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    records: dict[str, list] = {mode: [] for mode in built}
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)
        for mode, (sched, stages) in built.items():
            losses = _step(sched, stages, x, y)
            grads = [
                None if p.grad is None else p.grad.to_local().clone()
                for s in stages
                for p in s.submod.parameters()
            ]
            optimizers[mode].step()
            optimizers[mode].zero_grad()
            params = [p.to_local().detach().clone() for s in stages for p in s.submod.parameters()]
            records[mode].append({"losses": losses, "grads": grads, "params": params})
    return records


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    return run_scenarios({case: (lambda case=case: _pipeline(mesh, case)) for case in CASES})


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, PP * DP, timeout=900, pool=gloo_pool)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("schedule", CASES)
def test_graph_mode_stages_train_bitwise_like_eager_stages(run, schedule: str) -> None:
    for rank, record in enumerate(scenario_records(run, schedule)):
        for step, (graph, eager) in enumerate(zip(record["graph"], record["eager"], strict=True)):
            assert any(g is not None for g in eager["grads"]), (rank, step)
            for key in ("losses", "grads", "params"):
                assert _equal(graph[key], eager[key]), (rank, step, key)
