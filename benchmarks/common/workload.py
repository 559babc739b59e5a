"""The benchmarks' training workload on the repo's Llama (``dtensor_fsdp/models/llama.py``):
its FSDP groups, as ``train.py`` and torchtitan shard it (one group per
``TransformerBlock`` of ``model.layers``, then the root: the embeddings, the final norm
and the output head), and each rank's share of a seeded token batch."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def shard_blocks_then_root(
    model: nn.Module, fully_shard: Callable[..., nn.Module], **kwargs: object
) -> nn.Module:
    """``fully_shard(module, **kwargs)`` (ours or torch's) on each block, then on the
    root; returns the root."""
    for block in model.layers:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def group_params(model: nn.Module) -> list[list[nn.Parameter]]:
    """Each group's parameters, in that order: every block's, then the root's own."""
    groups = [list(block.parameters()) for block in model.layers]
    in_blocks = {id(p) for group in groups for p in group}
    return [*groups, [p for p in model.parameters() if id(p) not in in_blocks]]


def rank_tokens(seed: int, vocab_size: int, rows_per_rank: int, seq_len: int) -> torch.Tensor:
    """This rank's ``(rows_per_rank, seq_len + 1)`` tokens of a global batch drawn from
    ``seed`` (CPU): every rank draws the same ``W * rows_per_rank`` rows and keeps its
    own chunk, so the global batch does not depend on which rank looks."""
    generator = torch.Generator().manual_seed(seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens = torch.randint(vocab_size, (rows_per_rank * world, seq_len + 1), generator=generator)
    return tokens.chunk(world)[rank]
