"""A Llama split into pipeline stages, as torchtitan splits its models for pipeline
parallelism: consecutive blocks per stage, the embedding on the first stage, the final
norm and output head on the last. Parameter names (FQNs) stay the whole model's
(``layers.3.attention.wq.weight``), so a stage's state dict is a slice of the model's."""

import torch
from torch import nn

from .llama import Llama


class LlamaStage(nn.Module):
    """Blocks ``layer_ids`` of ``model``, taken over (not copied), with its embedding if
    ``is_first`` and its norm and output head if ``is_last``. The forward maps tokens
    (B, T) (first stage) or hidden states (B, T, dim) to hidden states (B, T, dim), or,
    on the last stage, logits (B, T, vocab_size)."""

    def __init__(self, model: Llama, layer_ids: range, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.tok_embeddings = model.tok_embeddings if is_first else None
        # A ModuleDict keyed by the layer index keeps the model's FQNs.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if is_last else None
        self.output = model.output if is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, head_dim // 2)
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        return self.output(self.norm(h))  # (B, T, vocab_size)


def split_into_stages(model: Llama, num_stages: int, stage_ids: list[int]) -> list[LlamaStage]:
    """Stages ``stage_ids`` of ``model`` cut into ``num_stages`` runs of consecutive
    blocks, the first ``n_layers % num_stages`` stages one block longer.

    Raises:
        ValueError: fewer blocks than stages, or tied embeddings (the first and last
            stages would share the weight across ranks).
    """
    n_layers = model.config.n_layers
    if n_layers < num_stages:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} pipeline stages")
    if model.config.tie_embeddings:
        raise ValueError("pipeline stages need untied embeddings (tie_embeddings=False)")
    base, extra = divmod(n_layers, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [
        LlamaStage(
            model,
            range(starts[s], starts[s + 1]),
            is_first=s == 0,
            is_last=s == num_stages - 1,
        )
        for s in stage_ids
    ]
