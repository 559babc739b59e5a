"""The divergence check on torch's fake process group, and its messages.

The fake group completes collectives without communicating: the check must read that
as agreement (it pre-fills the gathered rows with its own), not as a mismatch with
uninitialized memory, so a W=4 step runs with the checks on in one process.
"""

import torch

from dtensor_fsdp import fully_shard
from dtensor_fsdp.observe.consistency import CollectiveSignature, _mismatch_message
from tests._harness import fake_mesh
from tests.observe._divergence_job import DIM, Net


def test_fake_process_group_step_with_checks_on() -> None:
    with fake_mesh(4, rank=1) as mesh:
        model = Net([24, 32, 40])
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_divergence_check(True)
        model.set_nonfinite_grad_check(True)
        for _ in range(2):
            model(torch.randn(2, DIM)).backward()
        check = model._get_fsdp_state().check
        # Two steps: per step 4 forward all-gathers, 3 backward ones, 4 reduce-scatters.
        assert sum(check._seq.values()) == 2 * (4 + 3 + 4)


def test_mismatch_message_names_each_rank() -> None:
    signatures = [
        CollectiveSignature(7, "layers.1", "forward", "all_gather", 4096),
        CollectiveSignature(7, "layers.2", "forward", "all_gather", 4096),
    ]
    message = _mismatch_message([0, 1], signatures)
    assert "rank 0: all_gather #7 of 'layers.1' in forward (4,096 B)" in message
    assert "rank 1: all_gather #7 of 'layers.2' in forward (4,096 B)" in message
    assert "same fully_shard modules in the same order" in message


def test_mismatch_message_for_unused_params_suggests_the_setter() -> None:
    signatures = [
        CollectiveSignature(9, "", "backward", "reduce_scatter", 800),
        CollectiveSignature(9, "", "backward", "reduce_scatter", 640),
    ]
    message = _mismatch_message([0, 1], signatures)
    assert "reduce_scatter #9 of 'root' in backward (800 B)" in message
    assert "set_reduce_scatter_unused_params(True)" in message
