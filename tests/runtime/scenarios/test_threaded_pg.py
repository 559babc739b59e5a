"""Our ``fully_shard`` and torch's on torch's threaded test process group.

``FSDPTestMultiThread`` runs each test method once per rank, in one thread each, on
the in-process ``"threaded"`` backend: the backend torch's own FSDP2 unit tests use on
CPU. It cannot name a backend for a device (``_get_backend`` raises), so our
reduce-scatter takes the ``reduce_scatter_tensor`` branch with SUM, the one NCCL takes,
and the group splits that collective's input into W chunks along dim 0: the input must
be 1-D.

Threads share the global RNG, so models and data come from per-thread generators.
"""

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx

from dtensor_fsdp import CollectiveMismatchError, fully_shard, share_comm_ctx
from dtensor_fsdp.runtime.comm_description import ReductionOps
from tests._harness import FSDPTestMultiThread
from tests._mlp import shard_mlp
from tests._parity import make_optimizer
from tests.observe._divergence_job import Net

STEPS = 3


def _mlp() -> nn.Sequential:
    """tests/_mlp.py's MLP, initialized from a generator, not the global RNG."""
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


class TestThreadedProcessGroup(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _assert_same_locals(self, ours: nn.Module, theirs: nn.Module, where: str) -> None:
        """Same arithmetic (2-addend sums, exact in any order, then one division by 2:
        torch's AVG in the threaded group, our SUM then divide), so bitwise equal."""
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            self.assertTrue(torch.equal(a.to_local(), b.to_local()), f"{where} param {name}")
            if a.grad is not None or b.grad is not None:
                self.assertTrue(
                    torch.equal(a.grad.to_local(), b.grad.to_local()), f"{where} grad {name}"
                )

    def test_opsis_reduce_scatter_with_sum(self) -> None:
        group = init_device_mesh("cpu", (self.world_size,)).get_group(0)
        ops = ReductionOps.choose(
            group, group, torch.device("cpu"), prefer_average=True, custom=None
        )
        self.assertEqual(
            ops,
            ReductionOps(
                use_all_to_all=False, average_in_reduce_scatter=False, average_in_all_reduce=False
            ),
        )

    def test_training_matches_torch(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        base = _mlp()
        ours = shard_mlp(copy.deepcopy(base), mesh)
        theirs = shard_mlp(copy.deepcopy(base), mesh, shard=torch_fully_shard)
        opts = make_optimizer(ours.parameters()), make_optimizer(theirs.parameters())
        before = ours[0].weight.to_local().clone()
        for step in range(STEPS):
            x = _batch(step, self.rank)
            losses = [model(x).pow(2).mean() for model in (ours, theirs)]
            for loss in losses:
                loss.backward()
            self.assertEqual(losses[0].item(), losses[1].item(), f"step {step} loss")
            self._assert_same_locals(ours, theirs, f"rank {self.rank} step {step} grads")
            for opt in opts:
                opt.step()
                opt.zero_grad()
            self._assert_same_locals(ours, theirs, f"rank {self.rank} step {step} after step")
        # The parameters moved: not a comparison of two untouched copies.
        self.assertFalse(torch.equal(ours[0].weight.to_local(), before))

    def test_share_comm_ctx_between_two_roots_matches_torch(self) -> None:
        """Two roots, as pipeline-parallel model chunks are: blocks 0-1 and block 2."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        base = _mlp()
        chunks = {}
        for impl, shard, share in (
            ("ours", fully_shard, share_comm_ctx),
            ("torch", torch_fully_shard, torch_share_comm_ctx),
        ):
            model = copy.deepcopy(base)
            first, second = model[:2], model[2:]
            shard(first[0], mesh=mesh)
            shard(first, mesh=mesh)
            shard(second[0], mesh=mesh)
            shard(second, mesh=mesh)
            share([first, second])
            chunks[impl] = (first, second)
        for step in range(STEPS):
            x = _batch(step, self.rank)
            for first, second in chunks.values():
                second(first(x)).pow(2).mean().backward()
            for ours, theirs in zip(chunks["ours"], chunks["torch"], strict=True):
                self._assert_same_locals(ours, theirs, f"rank {self.rank} step {step}")
                for chunk in (ours, theirs):
                    chunk.zero_grad()

    def test_divergence_check_names_both_ranks_collectives(self) -> None:
        """Threads rendezvous on the check all-gather as gloo ranks do: an agreeing step
        trains, then rank 1 skipping block 1 raises on both threads, naming both."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = Net([24, 32, 40])
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_divergence_check(True)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(self.rank))
        model(x).backward()
        skip = 1 if self.rank == 1 else None
        with self.assertRaisesRegex(
            CollectiveMismatchError,
            r"rank 0: all_gather #\d+ of 'blocks.1'.*\n  rank 1: all_gather #\d+ of 'blocks.2'",
        ):
            model(x, skip=skip)
