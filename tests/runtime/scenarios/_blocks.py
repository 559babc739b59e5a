"""Small models the side-by-side scenario files share (``_side_by_side.py``): a
residual block, a stack of them between a stem and a head, and a token model with
embeddings and an output projection (tied or not)."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

DIM = 8
VOCAB, SEQ = 16, 6


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(x).relu())


class Block(nn.Module):
    """``x + ff(norm(x))``; ``utils_ac`` checkpoints its body with torch.utils.checkpoint."""

    def __init__(self, utils_ac: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = FeedForward()
        self.utils_ac = utils_ac

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.utils_ac:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Stack(nn.Module):
    """stem Linear -> blocks -> norm -> head Linear."""

    def __init__(self, blocks: int, utils_ac: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(utils_ac) for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class TokenModel(nn.Module):
    """Token and position embeddings -> blocks -> norm -> output projection to the
    vocabulary; ``tie`` shares the output weight with the token embedding."""

    def __init__(
        self, blocks: int = 3, tie: bool = False, utils_ac: bool = False, vocab: int = VOCAB
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block(utils_ac) for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, vocab, bias=False)
        if tie:
            self.output.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
