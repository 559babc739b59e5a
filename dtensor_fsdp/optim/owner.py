"""Owner ranks: whole matrices for the optimizers that need them, from sharded params.

[Note: owner exchange]
A matrix optimizer (Muon's Newton-Schulz iteration; Shampoo's or SOAP's preconditioners)
updates a 2-D parameter from its *whole* gradient matrix, but under FSDP every rank of
the shard group holds one chunk of each matrix. Running the update on DTensors makes
every matmul redistribute (torch.optim.Muon on ``Shard(0)`` params: several collectives
per Newton-Schulz iteration and per matrix), and all-gathering every matrix everywhere
makes every rank do all the work. Instead each matrix gets one *owner* rank of the
shard group, and per optimizer step and per shard group:

1. ``gather_to_owners``: one ``all_to_all_single`` in which every rank sends each owner
   its chunks of that owner's matrices; each owner concatenates the W chunks of each of
   its matrices, in rank order.
2. The owner runs the matrix update on its whole matrices (any function; Muon's is
   Newton-Schulz). The other ranks do not compute them at all.
3. ``scatter_from_owners``: one ``all_to_all_single`` returns to every rank its chunk of
   every result.

Each rank sends and receives (W-1)/W of the matrices' chunks per direction, like a ring
all-gather, but computes only the matrices it owns.

Chunks follow ``torch.chunk`` along the sharded dim (what DTensor's ``Shard(dim)`` means
for an uneven dim): ``ceil(n / W)`` rows or columns per rank, the trailing ranks
shorter or empty. The split sizes of the all-to-all carry the uneven chunks exactly,
so nothing is padded on the wire.

Owners are assigned greedily, largest cost first, each to the least-loaded rank so far
(ties to the lowest rank): the classic LPT rule, whose makespan is within 4/3 of the
best. The cost is the caller's (Muon: the Newton-Schulz flops of a matrix's shape).
Every rank builds the same plan from the same list of shapes, so owners agree without
communicating; the plan depends only on shapes and the group size.

What stays where: state that is element-wise (Muon's momentum) stays sharded like the
param, so checkpoints reshard it like any DTensor state. State that needs the whole
matrix (Shampoo's Kronecker factors) would live on the owner only; nothing here
builds it yet.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardedMatrix:
    """Where a 2-D tensor's chunks live in a shard group of ``world_size`` ranks."""

    shape: torch.Size
    """The whole (global) shape, (rows, cols)."""
    dim: int
    """The tensor dim split over the group: 0 (FSDP's ``Shard(0)``) or 1."""

    def chunk_size(self, world_size: int, rank: int) -> int:
        """Rows (dim 0) or columns (dim 1) of ``rank``'s chunk, ``torch.chunk``'s (may be 0)."""
        full = math.ceil(self.shape[self.dim] / world_size)
        return max(0, min(full, self.shape[self.dim] - rank * full))

    def chunk_shape(self, world_size: int, rank: int) -> torch.Size:
        shape = list(self.shape)
        shape[self.dim] = self.chunk_size(world_size, rank)
        return torch.Size(shape)

    def chunk_numel(self, world_size: int, rank: int) -> int:
        return math.prod(self.chunk_shape(world_size, rank))

    def chunks(self, whole: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """The W chunks of ``whole`` (views; empty ones for ranks past the end)."""
        sizes = [self.chunk_size(world_size, r) for r in range(world_size)]
        return list(whole.split(sizes, dim=self.dim))


def assign_owners(costs: Sequence[float], world_size: int) -> tuple[int, ...]:
    """An owner rank per item: largest cost first, each to the least-loaded rank (LPT).

    Deterministic: ties between costs go to the earlier item, ties between ranks to the
    lower rank, so every rank computes the same owners from the same costs.
    """
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
    return tuple(owners)


@dataclass(frozen=True)
class OwnerPlan:
    """Who owns which matrix in one shard group, and the all-to-all splits that follow.

    Built identically on every rank of the group (``plan_owners``).
    """

    matrices: tuple[ShardedMatrix, ...]
    owners: tuple[int, ...]
    """``owners[i]``: the group rank that updates ``matrices[i]``."""
    world_size: int
    rank: int
    """This process's rank in the group."""

    def owned(self, rank: int) -> list[int]:
        """Indices of the matrices ``rank`` owns, in order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def send_splits(self) -> list[int]:
        """gather_to_owners, per destination owner: numel of my chunks of its matrices."""
        return [
            sum(self.matrices[i].chunk_numel(self.world_size, self.rank) for i in self.owned(o))
            for o in range(self.world_size)
        ]

    def recv_splits(self) -> list[int]:
        """gather_to_owners, per source rank: numel of its chunks of my matrices."""
        mine = self.owned(self.rank)
        return [
            sum(self.matrices[i].chunk_numel(self.world_size, s) for i in mine)
            for s in range(self.world_size)
        ]


def plan_owners(
    matrices: Sequence[ShardedMatrix], costs: Sequence[float], world_size: int, rank: int
) -> OwnerPlan:
    """The plan for ``matrices`` with owners balanced by ``costs`` over ``world_size`` ranks."""
    assert len(matrices) == len(costs)
    return OwnerPlan(tuple(matrices), assign_owners(costs, world_size), world_size, rank)


def gather_to_owners(
    plan: OwnerPlan, chunks: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> dict[int, torch.Tensor]:
    """Step 1 of [Note: owner exchange]: one all-to-all; the whole matrices this rank owns.

    Args:
        plan: the group's plan.
        chunks: this rank's chunk of every matrix of the plan, in plan order, all of one
            dtype (what travels is what the owner computes on).

    Returns:
        ``{index: whole matrix}`` for every matrix this rank owns, contiguous, new memory.
    """
    dtype = chunks[0].dtype
    assert all(chunk.dtype == dtype for chunk in chunks), "one dtype per exchange"
    # Send buffer, 1-D: owner-major, then plan order within an owner.
    send = torch.cat(
        [chunks[i].reshape(-1) for o in range(plan.world_size) for i in plan.owned(o)]
        or [chunks[0].new_empty(0)]
    )
    recv_splits = plan.recv_splits()
    recv = send.new_empty(sum(recv_splits))  # 1-D: source-major, then plan order
    dist.all_to_all_single(recv, send, recv_splits, plan.send_splits(), group=group)
    mine = plan.owned(plan.rank)
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    for source, block in enumerate(recv.split(recv_splits)):
        numels = [plan.matrices[i].chunk_numel(plan.world_size, source) for i in mine]
        for i, flat in zip(mine, block.split(numels), strict=True):
            pieces[i].append(flat.view(plan.matrices[i].chunk_shape(plan.world_size, source)))
    return {i: torch.cat(pieces[i], dim=plan.matrices[i].dim) for i in mine}


def scatter_from_owners(
    plan: OwnerPlan,
    wholes: dict[int, torch.Tensor],
    group: dist.ProcessGroup,
    like: torch.Tensor,
) -> list[torch.Tensor]:
    """Step 3 of [Note: owner exchange]: one all-to-all; this rank's chunk of every result.

    Args:
        plan: the group's plan.
        wholes: ``{index: whole result}`` for every matrix this rank owns (all of
            ``like``'s dtype).
        like: gives the dtype and device of the receive buffer (used when this rank
            owns nothing).

    Returns:
        This rank's chunk of every matrix's result, in plan order (views into one buffer).
    """
    # Send buffer, 1-D: destination-major, then plan order within this owner.
    mine = plan.owned(plan.rank)
    send = torch.cat(
        [
            plan.matrices[i].chunks(wholes[i], plan.world_size)[d].reshape(-1)
            for d in range(plan.world_size)
            for i in mine
        ]
        or [like.new_empty(0)]
    )
    # The splits mirror gather_to_owners': what a rank sent an owner comes back.
    recv_splits = plan.send_splits()
    recv = like.new_empty(sum(recv_splits))  # 1-D: owner-major, then plan order
    dist.all_to_all_single(recv, send, recv_splits, plan.recv_splits(), group=group)
    results: list[torch.Tensor | None] = [None] * len(plan.matrices)
    for owner, block in enumerate(recv.split(recv_splits)):
        owned = plan.owned(owner)
        numels = [plan.matrices[i].chunk_numel(plan.world_size, plan.rank) for i in owned]
        for i, flat in zip(owned, block.split(numels), strict=True):
            results[i] = flat.view(plan.matrices[i].chunk_shape(plan.world_size, plan.rank))
    return results
