"""A model of many small modules, for automatic grouping's tests and benchmark
(``auto_shard``): ``n`` residual blocks of two ``Linear(d, d)``, then a ``LayerNorm``
and a ``Linear`` head, which stay in the root's group."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class BlockStack(nn.Module):
    def __init__(self, n_blocks: int = 8, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
