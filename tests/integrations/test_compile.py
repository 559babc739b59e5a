"""``torch.compile`` with ``fully_shard``: ours under the same compile call as torch's.

torch runs its FSDP hooks outside dynamo and marks the modules it manages, so a
compiled block sees plain parameters as graph inputs and FSDP's communication runs
eagerly around the graph. Ours must compose the same way. For each way users compile
(below), one spawn runs torch's ``fully_shard`` and ours from the same seed on the same
data and compares what a user sees:

- per-step losses and the final local shards, bit for bit (the same arithmetic: the
  compiled graphs are the same, and FSDP's collectives and casts are those of the
  eager tests);
- graph breaks (the sum of ``torch._dynamo.utils.counters["graph_break"]``) and the
  number of graphs dynamo compiled, measured for torch in the same run;
- the graphs themselves (aot_eager rows): the operators of every dynamo graph, which
  must be torch's, so no collective, storage resize or other FSDP step of ours was
  traced into a graph: the hooks stayed eager.

W=2, the ways to compile, on aot_eager (the graphs without inductor's codegen):
``block.compile()`` before ``fully_shard`` (also ``fullgraph=True``, torchtitan's
call), ``block.compile()`` after it, ``torch.compile(model)`` after it, and a
``torch.compile(block)`` swapped into the block list before sharding. Then torchtitan's
own path on inductor: meta-device model, activation checkpointing, per-block
``compile(backend="inductor", fullgraph=True)``, ``fully_shard`` with bf16 mixed
precision and explicit prefetch (``test_titan_recipe.py``'s recipe), for FSDP on 2
ranks and for FSDP+TP and HSDP on a 2 x 2 mesh on 4 (TP without activation
checkpointing: torch's own TP + AC + compile fails in torch 2.13 with "expected all
tensors_saved_with_vc_check to be Tensors", for its ``fully_shard`` and ours alike).
``benchmarks/bench_compile.py`` runs the whole matrix.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from dtensor_fsdp.models.llama import Llama, apply_tensor_parallel
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests._parity import assert_pairs_equal, make_optimizer
from tests.integrations.test_titan_recipe import (
    CONFIG,
    IMPLS,
    Impl,
    Meshes,
    _apply_fsdp,
    _local_shards,
    _meshes,
    _train_step,
)

STEPS = 3
SEED = 1


@dataclass(frozen=True)
class Run:
    losses: list[float]
    shards: dict[str, torch.Tensor]
    graph_breaks: int
    graphs: int
    graph_ops: list[list[str]]  # per dynamo graph, its sorted call_function targets


class GraphRecorder:
    """A dynamo backend: records each graph's operators, then compiles it with ``inner``."""

    def __init__(self, inner: str) -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graph_ops: list[list[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        ops = sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        self.graph_ops.append(ops)
        return self.inner(gm, example_inputs)


def _measure(build_and_train: Callable[[], tuple[list[float], nn.Module]]) -> tuple:
    """(losses, model, graph breaks, graphs) of one run, counted from a clean dynamo."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses, model = build_and_train()
    counters = torch._dynamo.utils.counters
    return losses, model, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------------------
# W=2: the ways users compile, aot_eager
# ---------------------------------------------------------------------------


def _compile_row(impl: Impl, row: str, meshes: Meshes, backend: GraphRecorder) -> nn.Module:
    """The fp32 Llama, sharded per block and at the root, compiled as ``row`` says."""
    torch.manual_seed(SEED)
    model = Llama(CONFIG)
    for name, block in list(model.layers.named_children()):
        if row == "compile_then_shard":
            block.compile(backend=backend)
        elif row == "compile_fullgraph_then_shard":
            block.compile(backend=backend, fullgraph=True)
        elif row == "swap_in_compiled_block":  # torchtitan's earlier way
            block = torch.compile(block, backend=backend)
            model.layers.register_module(name, block)
        impl.fully_shard(block, mesh=meshes.dp)
        if row == "shard_then_compile":
            block.compile(backend=backend)
    impl.fully_shard(model, mesh=meshes.dp)
    if row == "compile_model":
        return torch.compile(model, backend=backend)
    return model


def _train(model: nn.Module, meshes: Meshes) -> list[float]:
    optim = make_optimizer(model.parameters())
    return [_train_step(model, optim, meshes) for _ in range(STEPS)]


def _row(impl: Impl, row: str, meshes: Meshes) -> Run:
    backend = GraphRecorder("aot_eager")

    def build_and_train() -> tuple[list[float], nn.Module]:
        model = _compile_row(impl, row, meshes, backend)
        return _train(model, meshes), model

    losses, model, breaks, graphs = _measure(build_and_train)
    return Run(losses, _local_shards(model), breaks, graphs, backend.graph_ops)


ROWS = [
    "compile_then_shard",
    "compile_fullgraph_then_shard",
    "shard_then_compile",
    "compile_model",
    "swap_in_compiled_block",
]


# ---------------------------------------------------------------------------
# torchtitan's apply_compile on inductor: FSDP, FSDP+TP, HSDP
# ---------------------------------------------------------------------------


def _titan(impl: Impl, meshes: Meshes, activation_checkpointing: bool) -> Run:
    """torchtitan's order: meta model, TP, AC, per-block fullgraph inductor, FSDP."""

    def build_and_train() -> tuple[list[float], nn.Module]:
        with torch.device("meta"):
            model = Llama(CONFIG)
        if meshes.tp is not None:
            apply_tensor_parallel(model, meshes.tp)
        for name, block in list(model.layers.named_children()):
            if activation_checkpointing:
                block = checkpoint_wrapper(block, preserve_rng_state=False)
            block.compile(backend="inductor", fullgraph=True)
            model.layers.register_module(name, block)
        _apply_fsdp(model, meshes.dp, impl)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        with torch.no_grad():
            model.init_weights()
        return _train(model, meshes), model

    losses, model, breaks, graphs = _measure(build_and_train)
    return Run(losses, _local_shards(model), breaks, graphs, graph_ops=[])


def _hsdp_meshes() -> Meshes:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return Meshes(mesh, None, dist.get_rank())  # every rank its own batch


def _both(run: Callable[[Impl], Run]) -> dict[str, Run]:
    return {name: run(impl) for name, impl in IMPLS.items()}


def _worker(rank: int, world_size: int) -> dict:
    if world_size == 2:
        meshes = _meshes(tp=1)
        scenarios = {
            row: (lambda row=row: _both(lambda impl: _row(impl, row, meshes))) for row in ROWS
        }
        scenarios["titan_fsdp"] = lambda: _both(lambda impl: _titan(impl, meshes, True))
        return run_scenarios(scenarios)
    tp_meshes = _meshes(tp=2)
    return run_scenarios(
        {
            "titan_fsdp_tp": lambda: _both(lambda impl: _titan(impl, tp_meshes, False)),
            "titan_hsdp": lambda: _both(lambda impl: _titan(impl, _hsdp_meshes(), True)),
        }
    )


@pytest.fixture(scope="module")
def w2_run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, 2, timeout=400, pool=gloo_pool)


@pytest.fixture(scope="module")
def w4_run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, 4, timeout=400, pool=gloo_pool)


def _assert_same_as_torch(rec: dict[str, Run], where: str) -> None:
    ours, theirs = rec["ours"], rec["torch"]
    assert ours.losses == theirs.losses, f"{where}: losses {ours.losses} vs {theirs.losses}"
    assert theirs.losses[-1] < theirs.losses[0], f"{where}: did not train: {theirs.losses}"
    pairs = {n: (ours.shards[n], theirs.shards[n]) for n in theirs.shards}
    assert sorted(ours.shards) == sorted(theirs.shards), where
    assert_pairs_equal(pairs, f"{where} local shard")
    assert ours.graph_breaks <= theirs.graph_breaks, (
        f"{where}: {ours.graph_breaks} graph breaks, torch's fully_shard {theirs.graph_breaks}"
    )
    assert ours.graphs == theirs.graphs, f"{where}: {ours.graphs} graphs vs {theirs.graphs}"
    assert ours.graphs > 0, f"{where}: nothing was compiled"


@pytest.mark.parametrize("row", ROWS)
def test_compile_row_matches_torch_fully_shard(w2_run, row):
    for rank, rec in enumerate(scenario_records(w2_run, row)):
        _assert_same_as_torch(rec, f"{row} rank {rank}")


@pytest.mark.parametrize("row", ROWS)
def test_hooks_stay_out_of_the_graphs(w2_run, row):
    # The same graphs as torch's: no collective, storage resize or parameter swap of
    # ours was traced, and the block's compute was (no graph is missing).
    for rank, rec in enumerate(scenario_records(w2_run, row)):
        ours, theirs = rec["ours"].graph_ops, rec["torch"].graph_ops
        assert ours == theirs, f"{row} rank {rank}: the graphs differ from torch's"
        traced = {op for ops in ours for op in ops}
        assert not {op for op in traced if "c10d" in op or "resize_storage" in op}, traced


@pytest.mark.parametrize(
    "fixture,scenario",
    [("w2_run", "titan_fsdp"), ("w4_run", "titan_fsdp_tp"), ("w4_run", "titan_hsdp")],
)
def test_titan_apply_compile_matches_torch_fully_shard(request, fixture, scenario):
    run = request.getfixturevalue(fixture)
    for rank, rec in enumerate(scenario_records(run, scenario)):
        _assert_same_as_torch(rec, f"{scenario} rank {rank}")
        assert rec["ours"].graph_breaks == 0, f"{scenario}: fullgraph=True compiled with breaks"
