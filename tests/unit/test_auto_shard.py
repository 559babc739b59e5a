"""auto_shard on the fake process group: the chosen calls fit the budget by the
verifying simulation, cut collectives against one group per block, keep the root's
parameters, explain every choice, and bad input fails early and clearly."""

import json

import pytest
import torch
from torch import nn

from dtensor_fsdp import AutoPlan, auto_shard
from dtensor_fsdp.models.block_stack import BlockStack

N_BLOCKS, DIM, BATCH = 8, 16, 8


def _auto(budget_bytes: int, **settings) -> AutoPlan:
    return auto_shard(
        lambda: BlockStack(N_BLOCKS, DIM),
        budget_bytes=budget_bytes,
        world_size=2,
        batch=lambda: torch.randn(BATCH, DIM),
        **settings,
    )


@pytest.fixture(scope="module")
def roomy() -> AutoPlan:
    """A budget large enough to keep every group unsharded."""
    return _auto(2**30)


@pytest.fixture(scope="module")
def finest_peak(roomy: AutoPlan) -> int:
    return roomy.baseline.peak_bytes


@pytest.fixture(scope="module")
def tight(finest_peak: int) -> AutoPlan:
    """The smallest budget: the finest grouping's peak."""
    return _auto(finest_peak)


def test_predicted_peak_within_budget(roomy: AutoPlan, tight: AutoPlan) -> None:
    middle = _auto(int(1.3 * tight.budget_bytes))
    for auto in (roomy, tight, middle):
        assert auto.plan.peak_bytes <= auto.budget_bytes
        assert auto.simulations <= 4
    # More room, fewer collectives.
    counts = [sum(e["count"] for e in a.plan.collectives.values()) for a in (tight, middle, roomy)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_fewer_collectives_than_one_group_per_block(roomy: AutoPlan) -> None:
    def total(plan) -> int:
        return sum(entry["count"] for entry in plan.collectives.values())

    # 8 blocks in 4 groups of 2, all kept: 4 x (1 all-gather + 1 reduce-scatter) and
    # the root's 2, against 8 x 3 and 2.
    assert [len(g.fqns) for g in roomy.groups] == [2, 2, 2, 2]
    assert total(roomy.plan) == 10 and total(roomy.baseline) == 26
    assert total(roomy.plan) <= 0.5 * total(roomy.baseline)


def test_below_the_smallest_budget_names_it(finest_peak: int) -> None:
    with pytest.raises(ValueError, match=rf"budget_bytes >= {finest_peak}\b"):
        _auto(finest_peak - 1)


def test_root_keeps_its_params(roomy: AutoPlan, tight: AutoPlan) -> None:
    for auto in (roomy, tight):
        root = next(g for g in auto.plan.groups if g.fqn == "")
        assert root.reshard_after_forward is False
        assert root.collectives["all_gather"]["count"] == 1


def test_every_choice_explained(roomy: AutoPlan) -> None:
    text = str(roomy)
    for head in ("blocks:", "merge:", "reshard_after_forward=False for", "root:", "prefetch:"):
        assert head in text
    assert "fully_shard(list(model.blocks[0:2]), reshard_after_forward=False)" in text
    out = json.loads(roomy.to_json())
    assert out["explanations"] == list(roomy.explanations)
    assert out["groups"][0] == {
        "fqns": ["blocks.0", "blocks.1"],
        "reshard_after_forward": False,
    }
    assert out["plan"]["peak_bytes"] == roomy.plan.peak_bytes <= out["budget_bytes"]


def test_a_model_without_blocks_is_one_group() -> None:
    auto = auto_shard(
        lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
        budget_bytes=2**30,
        world_size=2,
        batch=lambda: torch.randn(2, 4),
    )
    assert auto.groups == () and [g.fqn for g in auto.plan.groups] == [""]


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="drop shard_fn"):
        _auto(2**30, shard_fn=lambda model, **kw: None)
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        _auto(0)


def test_apply_to_another_model_names_the_module(roomy: AutoPlan) -> None:
    with pytest.raises(ValueError, match="has no module 'blocks.0'"):
        roomy.apply(nn.Linear(2, 2))
