"""``train.py --compile`` (issue 19), against the same recipe on torch's ``fully_shard``.

``--compile`` compiles each transformer block torchtitan's way
(``block.compile(backend="inductor", fullgraph=True)``, after activation checkpointing
and before ``fully_shard``). The reference builds ``train.py``'s model with ``train.py``'s
own functions (init, ``checkpoint_forward``, ``compile_blocks``, optimizers, data,
``train_step``) and shards it with torch's ``fully_shard`` instead of ours, the same
grouping (each block, then the root).

Checked, with and without ``--activation-checkpointing``, on 2 ranks:

- torch's run compiles (at least one dynamo graph: ``--compile`` is not a no-op) with no
  graph break: torch keeps its FSDP hooks out of dynamo (``torch._dynamo.disable`` on
  each hook, and marks on the managed modules that dynamo's variable builder reads);
- ours compiles the same number of graphs with no graph break, and its per-step losses,
  grad norms and final full parameters are bitwise equal to torch's: the same inductor
  kernels run on the same values, and the reductions over two ranks are exact in
  either order ([Note: parity tolerances] in ``_parity.py``, item 1).

Graphs and breaks are read from ``torch._dynamo.utils.counters`` after a
``torch._dynamo.reset()`` and cleared counters, in each rank's own process.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import train
from dtensor_fsdp.models.llama import Llama
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import full
from tests._pool import GlooPools

FLAGS = [
    "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
    "--vocab-size", "128", "--seq-len", "16", "--batch-size", "2", "--steps", "3",
    "--compile",
]  # fmt: skip
AC = ["--activation-checkpointing"]


def _compile_counts() -> dict[str, int]:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _scenario_ours(flags: list[str], path: str) -> dict:
    _fresh_dynamo()
    train.train(train.parse_args([*flags, "--metrics-out", path]), torch.device("cpu"))
    counts = _compile_counts()
    dist.barrier()  # rank 0 has written the file
    with open(path) as f:
        return {**json.load(f), **counts}


def _scenario_torch(flags: list[str]) -> dict:
    """train.py's ``build_model`` and ``train`` loop, with torch's ``fully_shard``."""
    _fresh_dynamo()
    args = train.parse_args(flags)
    config = train.build_config(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Llama(config)
    train.init_from_seed(model, args.seed)
    if args.activation_checkpointing:
        for block in model.layers:
            train.checkpoint_forward(block)
    train.compile_blocks(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in [*model.layers, model]:
        torch_fully_shard(module, mesh=mesh, reshard_after_forward=True)
    optimizers = train.build_optimizers(model, args)
    generator = torch.Generator().manual_seed(args.seed)
    rows = args.batch_size * world_size
    losses, grad_norms = [], []
    for _ in range(args.steps):
        global_batch = train.synthetic_batch(generator, rows, config.max_seq_len, config.vocab_size)
        tokens = train.local_rows(global_batch, rank, world_size)
        loss, grad_norm = train.train_step(model, optimizers, tokens, args)
        losses.append(train.mean_over_ranks(loss))
        grad_norms.append(grad_norm.item())
    params = {name: full(p).flatten().tolist() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "params": params, **_compile_counts()}


def _worker(rank: int, world_size: int, directory: str) -> dict:
    scenarios = {}
    for label, flags in {"plain": FLAGS, "ac": [*FLAGS, *AC]}.items():
        path = os.path.join(directory, f"{label}.json")
        scenarios[f"torch_{label}"] = lambda flags=flags: _scenario_torch(flags)
        scenarios[f"ours_{label}"] = lambda flags=flags, path=path: _scenario_ours(flags, path)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list:
    # A first inductor compile takes tens of seconds on two loaded cores.
    tmp = str(tmp_path_factory.mktemp("compile"))
    return run_distributed(_worker, 2, tmp, timeout=600, pool=gloo_pool)


@pytest.mark.parametrize("label", ["plain", "ac"])
def test_torch_reference_compiles_without_graph_breaks(run, label: str) -> None:
    for rank, rec in enumerate(scenario_records(run, f"torch_{label}")):
        assert rec["graphs"] >= 1, f"rank {rank}: nothing compiled"
        assert rec["graph_breaks"] == 0, f"rank {rank}: {rec['graph_breaks']} graph breaks"


@pytest.mark.parametrize("label", ["plain", "ac"])
def test_ours_matches_torch_bitwise(run, label: str) -> None:
    reference = scenario_records(run, f"torch_{label}")
    for rank, rec in enumerate(scenario_records(run, f"ours_{label}")):
        assert rec["graph_breaks"] == 0, f"rank {rank}: {rec['graph_breaks']} graph breaks"
        assert rec["graphs"] == reference[rank]["graphs"], f"rank {rank}"
    ours, ref = scenario_records(run, f"ours_{label}")[0], reference[0]
    assert ours["losses"] == ref["losses"]
    assert ours["grad_norms"] == ref["grad_norms"]
    assert ours["params"].keys() == ref["params"].keys()
    for name in ours["params"]:
        assert ours["params"][name] == ref["params"][name], f"{name} not bitwise equal"
