"""auto_shard's calls against the same calls written by hand, on 2 gloo ranks: the
applied plan trains bitwise as the hand-written ``fully_shard`` calls (losses and
parameter shards) and sends the same collectives at the c10d level; torch's
``fully_shard`` with the same calls sends the same collectives (count and bytes) and
trains to the same values; the measured peak stays within the budget.
"""

from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import AutoPlan, auto_shard, fully_shard, plan
from dtensor_fsdp.models.block_stack import BlockStack
from dtensor_fsdp.plan.auto import AutoGroup, apply_calls
from tests._c10d import C10dRecorder
from tests._harness import end_watchdog, run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

N_BLOCKS, DIM, BATCH, STEPS = 8, 32, 16, 3
BUDGET_OVER_FINEST = 1.3  # room to merge blocks and keep the last group, not more


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, DIM)


@pytest.fixture(scope="module")
def auto() -> AutoPlan:
    # plan()'s default groups are auto_shard's finest: one per block, then the root.
    # Planned for gloo, where it runs: its reduce-scatter's receive buffer counts.
    settings = {"world_size": 2, "batch": _batch, "backend": "gloo"}
    finest = plan(lambda: BlockStack(N_BLOCKS, DIM), **settings).peak_bytes
    return auto_shard(
        lambda: BlockStack(N_BLOCKS, DIM),
        budget_bytes=int(BUDGET_OVER_FINEST * finest),
        **settings,
    )


def _by_hand(model: BlockStack, shard: Any, mesh: Any) -> None:
    """The calls auto_shard reports for this model and budget, written out."""
    b = model.blocks
    shard([b[0], b[1]], mesh=mesh, reshard_after_forward=True)
    shard([b[2], b[3]], mesh=mesh, reshard_after_forward=True)
    shard([b[4], b[5]], mesh=mesh, reshard_after_forward=True)
    shard([b[6], b[7]], mesh=mesh, reshard_after_forward=False)
    shard(model, mesh=mesh)
    model.set_modules_to_forward_prefetch([b[0]])
    b[0].set_modules_to_forward_prefetch([b[2]])
    b[2].set_modules_to_forward_prefetch([b[4]])
    b[4].set_modules_to_forward_prefetch([b[6]])


def _train(apply: Any) -> dict[str, Any]:
    """STEPS AdamW steps on per-rank batches: losses, local shards, the c10d
    collectives of each step, and MemTracker's peak of the last step."""
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = BlockStack(N_BLOCKS, DIM)
    apply(model, mesh)
    torch.manual_seed(1 + rank)
    batches = [_batch() for _ in range(STEPS)]
    losses, collectives = [], []
    with MemTracker() as tracker:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in batches:
            tracker.reset_mod_stats()
            # MemTracker has no public reset: the two fields its __enter__ sets.
            tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
            tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
            recorder = C10dRecorder()
            with recorder:
                loss = model(x).sum()
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            collectives.append(recorder.records)
        peak = tracker.get_tracker_snapshot("peak")
    end_watchdog(model)
    return {
        "losses": losses,
        "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
        "collectives": collectives,
        "peak": sum(s["Total"] for d, s in peak.items() if d.type == "cpu"),
    }


def _run(
    rank: int, world_size: int, groups: tuple[AutoGroup, ...], forward_prefetch: int
) -> dict[str, Any]:
    return run_scenarios(
        {
            "auto": lambda: _train(
                lambda m, mesh: apply_calls(m, groups, forward_prefetch, mesh=mesh)
            ),
            "hand": lambda: _train(lambda m, mesh: _by_hand(m, fully_shard, mesh)),
            "torch": lambda: _train(lambda m, mesh: _by_hand(m, torch_fully_shard, mesh)),
        }
    )


@pytest.fixture(scope="module")
def runs(auto: AutoPlan, gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, 2, auto.groups, auto.forward_prefetch, pool=gloo_pool)


def _totals(records: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes)}``; ours' gloo reduce-scatter is an all-to-all of the
    same buffer (gloo's reduce_scatter_tensor is a full all-reduce plus a copy-out,
    twice a ring's traffic), torch's a reduce_scatter: one kind here."""
    out: dict[str, tuple[int, int]] = {}
    for kind, size in records:
        kind = "reduce_scatter" if kind == "all_to_all" else kind
        count, nbytes = out.get(kind, (0, 0))
        out[kind] = (count + 1, nbytes + size)
    return out


def test_reported_calls_are_the_hand_written_ones(auto: AutoPlan) -> None:
    blocks = [f"blocks.{i}" for i in range(N_BLOCKS)]
    assert auto.groups == tuple(
        AutoGroup(tuple(blocks[i : i + 2]), i < 6) for i in range(0, N_BLOCKS, 2)
    )
    assert auto.forward_prefetch == 1


def test_auto_trains_bitwise_as_by_hand(runs: list[dict[str, Any]]) -> None:
    for ours, hand in zip(scenario_records(runs, "auto"), scenario_records(runs, "hand")):
        assert ours["losses"] == hand["losses"]
        assert ours["params"].keys() == hand["params"].keys()
        for name, value in ours["params"].items():
            assert torch.equal(value, hand["params"][name]), name
        assert ours["collectives"] == hand["collectives"]


def test_same_calls_under_torch(runs: list[dict[str, Any]], auto: AutoPlan) -> None:
    """torch's fully_shard with the same calls sends as many collectives of the same
    bytes, and at W=2 sums the same two gradients: the same values bitwise. The first
    group's first block takes the batch, which needs no grad: the group's post-backward
    comes at the end of backward (torch's group hooks register it on the first
    module's inputs only), not early from the second block's inputs, which would
    re-gather and reduce the group twice."""
    for ours, theirs in zip(scenario_records(runs, "auto"), scenario_records(runs, "torch")):
        for mine, torchs in zip(ours["collectives"], theirs["collectives"]):
            assert _totals(mine) == _totals(torchs)
        assert ours["losses"] == theirs["losses"]
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), name
    # The gloo plan counts ours' reduce-scatter as the all-to-all it sends, as _totals.
    predicted = {
        "reduce_scatter" if kind == "all_to_all" else kind: (entry["count"], entry["bytes"])
        for kind, entry in auto.plan.collectives.items()
    }
    assert _totals(scenario_records(runs, "auto")[0]["collectives"][-1]) == predicted


def test_measured_peak_within_budget(runs: list[dict[str, Any]], auto: AutoPlan) -> None:
    for record in scenario_records(runs, "auto"):
        print(f"measured peak {record['peak']} <= budget {auto.budget_bytes}")
        assert record["peak"] <= auto.budget_bytes
