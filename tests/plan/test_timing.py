"""The plan's event model of a step (``dtensor_fsdp/plan/timing.py``), worked by hand on
two groups under a root: what forward prefetch hides, what a kept group saves, when
merging pays (fixed costs) and when it does not (bytes exposed), and the costs read
from a simulated plan."""

import dataclasses

import pytest
import torch

from dtensor_fsdp import plan
from dtensor_fsdp.models.block_stack import BlockStack
from dtensor_fsdp.plan.timing import Cost, gathered_again, step_s

# Times in arbitrary units (the model is linear in them): the root gathers 1 and reduces
# 1 with no compute of its own; each block computes 10 forward and 20 backward, gathers
# 2 and reduces 3.
ROOT = Cost(forward_s=0, backward_s=0, all_gather_s=1, reduce_s=1, reductions=1, gathers=True)
BLOCK = Cost(forward_s=10, backward_s=20, all_gather_s=2, reduce_s=3, reductions=1, gathers=True)
OVERHEAD = 0.5


def test_one_group_per_block_resharded() -> None:
    # Forward: root gather ends 1.5; block 0's gather is issued at 1.5 (+0.5 on the
    # host), ends 4, computes to 14; block 1's is issued then, ends 16.5, computes to
    # 26.5. Backward: block 1's gather (the root's implicit prefetch) ends 29; block 0's
    # is issued at 29 and ends 31.5 while block 1 computes to 49.5; block 1's reduction
    # is issued (50) and ends 53; block 0 computes to 70, reduces to 73.5; the root's
    # reduction, issued at 71, waits for the link: 74.5.
    assert step_s(ROOT, [BLOCK, BLOCK], [False, False], 0, OVERHEAD) == 74.5


def test_forward_prefetch_hides_the_next_gather() -> None:
    # Block 1's gather is issued when block 0's compute starts (4.5 on the host) and
    # ends at 6.5, under that compute: forward ends 2 earlier, and so does the step.
    assert step_s(ROOT, [BLOCK, BLOCK], [False, False], 1, OVERHEAD) == 72.5


def test_deeper_prefetch_uses_an_earlier_idle_link() -> None:
    """A long compute, then none, then a large all-gather: at depth 1 the third group's
    all-gather is issued after the long compute, at depth 2 during it."""
    long_ = Cost(10, 20, 2, 3, 1, True)
    empty = Cost(0, 20, 2, 3, 1, True)
    large = Cost(10, 20, 5, 3, 1, True)
    groups, kept = [long_, empty, large], [True] * 3
    depth = [step_s(ROOT, groups, kept, d, OVERHEAD) for d in (0, 1, 2)]
    # The backward is the same at every depth (all kept: no gathers), 65.5 after the
    # forward. Depth 0: the forward ends at 32 (the second gather exposed 2 after the
    # long compute, the third 5 after it). Depth 1: the second gather runs under the
    # long compute, the third is issued at 15 and ends at 20: 30. Depth 2: the third is
    # issued at 4.5 and ends at 11, under the long compute too: 24.5.
    assert depth == [32 + 65.5, 30 + 65.5, 24.5 + 65.5]


def test_kept_groups_skip_the_backward_gathers() -> None:
    # Forward as resharded (26.5); backward has no gathers: block 1 computes to 46.5,
    # its reduction is issued (47) and ends 50; block 0 computes to 67 and reduces from
    # 67.5 to 70.5; the root's, issued at 68, waits for the link: 71.5.
    assert step_s(ROOT, [BLOCK, BLOCK], [True, True], 0, OVERHEAD) == 71.5


def test_merging_pays_for_fixed_costs_not_for_bytes() -> None:
    merged = Cost.merged([BLOCK, BLOCK])
    assert merged == Cost(20, 40, 4, 6, 1, True)
    # Bytes dominate at a small fixed cost: the merged gather (4) is exposed whole.
    assert step_s(ROOT, [merged], [False], 0, OVERHEAD) == 78.0
    assert step_s(ROOT, [merged], [False], 0, OVERHEAD) > step_s(
        ROOT, [BLOCK, BLOCK], [False, False], 0, OVERHEAD
    )
    # A large fixed cost: one group's two collectives fewer win.
    assert step_s(ROOT, [merged], [False], 0, 10.0) < step_s(
        ROOT, [BLOCK, BLOCK], [False, False], 0, 10.0
    )


def test_a_frozen_group_the_backward_does_not_reach() -> None:
    """Frozen blocks first, the batch needing no grad: the backward reaches neither; the
    second is gathered again as the prefetch of the third's backward, the first is
    not, so resharding it costs what keeping it does."""
    frozen = dataclasses.replace(BLOCK, backward_s=0, reduce_s=0, reductions=0, reached=False)
    groups = [frozen, frozen, BLOCK]
    assert gathered_again(groups, [False] * 3) == [False, True, True]
    assert gathered_again(groups, [False, True, False]) == [False, False, True]
    assert step_s(ROOT, groups, [False] * 3, 0, OVERHEAD) == step_s(
        ROOT, groups, [True, False, False], 0, OVERHEAD
    )
    assert Cost.merged(groups[:2]).reached is False
    assert Cost.merged(groups[1:]).reached is True


def test_no_communication_is_the_compute() -> None:
    quiet = Cost(10, 20, 0, 0, 0, False)
    root = Cost(1, 2, 0, 0, 0, False)
    assert step_s(root, [quiet] * 3, [False] * 3, 1, OVERHEAD) == 1 + 2 + 3 * 30


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_costs_from_a_plan(backend: str) -> None:
    """A block's cost from the simulated plan: its FLOPs at ``tflops``; its forward
    comm is one all-gather, its backward one all-gather more and the reduction."""
    simulated = plan(
        lambda: BlockStack(2, 16),
        world_size=2,
        batch=lambda: torch.randn(8, 16),
        backend=backend,
        tflops=1e-6,
    )
    rows = {g.fqn: g for g in simulated.groups}
    block = Cost.of(rows["blocks.0"], tflops=1e-6)
    assert block.forward_s == rows["blocks.0"].forward_flops / 1e6 > 0
    assert block.backward_s == rows["blocks.0"].backward_flops / 1e6 > block.forward_s
    assert block.gathers and block.reductions == 1
    # Ring traffic over the link (400 Gbit/s, plan()'s default): half of each unsharded
    # buffer at W=2; the reduce-scatter's buffer is the gradients (fp32, as the params).
    def link_s(nbytes: int) -> float:
        return nbytes / 2 * 8 / 400e9

    for fqn, cost in (("blocks.0", block), ("", Cost.of(rows[""], tflops=1e-6))):
        collectives = rows[fqn].collectives
        gathers = collectives["all_gather"]
        assert cost.all_gather_s == pytest.approx(link_s(gathers["bytes"] / gathers["count"]))
        assert cost.reduce_s == pytest.approx(link_s(collectives["reduce_scatter"]["bytes"]))
    # The root is kept from forward to backward: gathered once.
    assert rows[""].collectives["all_gather"]["count"] == 1
