"""Frozen, tied and ignored parameters on 2 gloo ranks, against a single-process
reference on the global batch. One spawn runs every scenario.
"""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dtensor_fsdp import (
    CommTrace,
    fully_shard,
)
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp
from tests._parity import assert_pairs_close, full, full_pairs
from tests._pool import GlooPools
from tests.runtime._lockstep import (
    BATCH,
    STEPS,
    WORLD_SIZE,
    _batch,
    _local,
    _sgd,
    _trainable_grads,
)


class LoRALinear(nn.Module):
    """A frozen Linear(16, 16) plus a trainable rank-4 update."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 16, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _frozen(rank: int, mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), LoRALinear(), nn.ReLU(), nn.Linear(16, 3))
    base[0].requires_grad_(False)
    ref = copy.deepcopy(base)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    fully_shard(base[2], mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    trace = CommTrace()
    model.set_comm_trace(trace)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_optim = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    records = []
    for step in range(STEPS):
        trace.clear()
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
        F.mse_loss(ref(x), y).backward()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        rec = {
            "grad_is_none": {n: p.grad is None for n, p in model.named_parameters()},
            "grads": {n: pair for n, pair in _trainable_grads(model, ref).items() if n in trainable},
            "comms": [(e.kind, e.fqn, e.nbytes) for e in sorted(trace.events, key=lambda e: e.start_s)],
        }
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    frozen_moved = {
        n: not torch.equal(full(p), frozen_before[n])
        for n, p in model.named_parameters() if n in frozen_before
    }
    return {"records": records, "frozen_moved": frozen_moved}


class TiedNet(nn.Module):
    """Embedding and output head share one weight; both are the root's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.block(self.emb(tokens))))


def _tied(rank: int, mesh: Any) -> dict[str, Any]:
    base = TiedNet()
    ref = copy.deepcopy(base)
    fully_shard(base.block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    gen = torch.Generator().manual_seed(0)
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 16, (WORLD_SIZE * BATCH, 6), generator=gen)
        inp, tgt = tokens[:, :-1], tokens[:, 1:]

        def ce(m: nn.Module, i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(m(i).flatten(0, 1), t.flatten(0, 1))

        ce(model, _local(inp, rank), _local(tgt, rank)).backward()
        ce(ref, inp, tgt).backward()
        records.append({"grads": full_pairs(model, ref, grads=True)})
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        records[-1]["params"] = full_pairs(model, ref, grads=False)
    return {
        "records": records,
        "still_tied": model.head.weight is model.emb.weight,
        "param_names": [n for n, _ in model.named_parameters()],
    }


def _tied_across_groups(mesh: Any) -> dict[str, Any]:
    model = TiedNet()
    fully_shard(model.emb, mesh=mesh)
    try:
        fully_shard(model.head, mesh=mesh)
        return {"error": None}
    except ValueError as error:
        return {
            "error": str(error),
            "head_untouched": type(model.head) is nn.Linear and not isinstance(model.head.weight, DTensor),
        }


def _ignored(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    ref_local = copy.deepcopy(base)  # this rank's rows only: the unreduced grad
    fully_shard(base[0], mesh=mesh)
    fully_shard(base[2], mesh=mesh)
    model = fully_shard(base, mesh=mesh, ignored_params={base[4].weight})
    trace = CommTrace()
    model.set_comm_trace(trace)
    x, y = _batch(0)
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(ref_local(_local(x, rank)), _local(y, rank)).backward()
    return {
        "types": {n: type(p).__name__ for n, p in model.named_parameters()},
        "ignored_grad": (model[4].weight.grad.clone(), ref_local[4].weight.grad.clone()),
        "global_grad": ref[4].weight.grad.clone(),
        "grads": {n: pair for n, pair in full_pairs(model, ref, grads=True).items() if n != "4.weight"},
        "root_bytes": [(e.kind, e.nbytes) for e in trace.events if e.fqn == ""],
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "frozen": lambda: _frozen(rank, mesh),
        "tied": lambda: _tied(rank, mesh),
        "tied_across_groups": lambda: _tied_across_groups(mesh),
        "ignored": lambda: _ignored(rank, mesh),
    })


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=180, pool=gloo_pool)


def test_frozen_params_get_no_grad_and_no_reduce_scatter_bytes(run):
    for rec in scenario_records(run, "frozen"):
        for step in rec["records"]:
            assert step["grad_is_none"] == {
                "0.weight": True, "0.bias": True,
                "2.base.weight": True, "2.base.bias": True,
                "2.lora_a.weight": False, "2.lora_b.weight": False,
                "4.weight": False, "4.bias": False,
            }
            assert_pairs_close(step["grads"], "trainable grad")
            assert_pairs_close(step["params"], "param")
        assert rec["frozen_moved"] == {"0.weight": False, "0.bias": False, "2.base.weight": False, "2.base.bias": False}
    comms = scenario_records(run, "frozen")[0]["records"][0]["comms"]
    # All-gathers carry every param: group 2 is (16x16 + 16 + 4x16 + 16x4) fp32, the
    # root 0's (16x8 + 16) and 4's (2 ranks x 2 rows x 16, 2 x 2) padded. Reduce-scatters
    # carry the trainable ones only: the root 4.weight and 4.bias padded as above, group
    # 2 lora_a (4x16) + lora_b (16x4). Group 2 resharded after forward and is gathered
    # again for backward. Its input comes from a frozen layer and has no grad, so it
    # reduce-scatters from the final callback, after the root.
    assert comms == [
        ("all_gather", "", (16 * 8 + 16 + 4 * 16 + 4) * 4),
        ("all_gather", "2", (16 * 16 + 16 + 4 * 16 + 16 * 4) * 4),
        ("all_gather", "2", (16 * 16 + 16 + 4 * 16 + 16 * 4) * 4),
        ("reduce_scatter", "", (4 * 16 + 4) * 4),
        ("reduce_scatter", "2", (4 * 16 + 16 * 4) * 4),
    ]


def test_tied_params_in_one_group(run):
    for rec in scenario_records(run, "tied"):
        assert rec["still_tied"]
        assert rec["param_names"] == ["emb.weight", "block.weight", "block.bias"]
        for step in rec["records"]:
            assert_pairs_close(step["grads"], "tied grad")
            assert_pairs_close(step["params"], "tied param")


def test_tied_params_across_groups_raise(run):
    rec = scenario_records(run, "tied_across_groups")[0]
    assert rec["error"] is not None and "shared with a parameter already managed by another FSDP group" in rec["error"]
    assert rec["head_untouched"]


def test_ignored_params_stay_plain_and_unreduced(run):
    for rank, rec in enumerate(scenario_records(run, "ignored")):
        assert rec["types"] == {
            "0.weight": "DTensor", "0.bias": "DTensor", "2.weight": "DTensor",
            "2.bias": "DTensor", "4.weight": "Parameter", "4.bias": "DTensor",
        }
        ours, local_ref = rec["ignored_grad"]
        torch.testing.assert_close(ours, local_ref, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(ours, rec["global_grad"])  # not averaged over ranks
        assert_pairs_close(rec["grads"], f"rank {rank} grad")
        # The root group holds 4.bias only: 3 values padded to 2 per rank, fp32.
        assert rec["root_bytes"] == [("all_gather", 16), ("reduce_scatter", 16)]
