"""``train.py --graph`` (issue 31): graph mode (``dtensor_fsdp.compile``) in the trainer.

On 2 gloo ranks, ``train.py``'s own ``train`` runs the same flags twice, eager and with
``--graph --graph-backend aot_eager``: graph mode without fusion runs the eager
arithmetic op for op (graph/backend.py), so per-step losses, grad norms and the final
full parameters must be bitwise equal, and dynamo must compile at least one graph with
no graph break. (inductor fuses, so it is not bitwise; ``bench_graph.py`` compares it.)

The flags graph mode does not combine with fail in ``parse_args``, naming them.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import train
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

FLAGS = [
    "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
    "--vocab-size", "128", "--seq-len", "16", "--batch-size", "2", "--steps", "3",
]  # fmt: skip
GRAPH = ["--graph", "--graph-backend", "aot_eager"]


def _train(flags: list[str], path: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    train.train(train.parse_args([*flags, "--metrics-out", path]), torch.device("cpu"))
    compiled = {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    dist.barrier()  # rank 0 has written the file
    with open(path) as f:
        return {**json.load(f), **compiled}


def _worker(rank: int, world_size: int, directory: str) -> dict:
    return run_scenarios(
        {
            "eager": lambda: _train(FLAGS, os.path.join(directory, "eager.json")),
            "graph": lambda: _train([*FLAGS, *GRAPH], os.path.join(directory, "graph.json")),
        }
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list:
    tmp = str(tmp_path_factory.mktemp("graph"))
    return run_distributed(_worker, 2, tmp, timeout=300, pool=gloo_pool)


def test_graph_aot_eager_trains_bitwise_as_eager(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "graph")):
        assert rec["graphs"] >= 1, f"rank {rank}: nothing compiled"
        assert rec["graph_breaks"] == 0, f"rank {rank}: {rec['graph_breaks']} graph breaks"
    graph, eager = scenario_records(run, "graph")[0], scenario_records(run, "eager")[0]
    assert graph["losses"] == eager["losses"]
    assert graph["grad_norms"] == eager["grad_norms"]
    assert graph["params"].keys() == eager["params"].keys()
    for name in eager["params"]:
        assert graph["params"][name] == eager["params"][name], f"{name} not bitwise equal"


@pytest.mark.parametrize("flag", [["--compile"], ["--cpu-offload"], ["--trace-comms", "t.json"]])
def test_graph_rejects_what_it_does_not_combine_with(flag: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        train.parse_args(["--graph", *flag])
    assert f"--graph does not combine with {flag[0]}" in capsys.readouterr().err
