"""A small Llama-style decoder-only transformer in plain PyTorch.

The structure and parameter names follow Meta's Llama reference and torchtitan
(``tok_embeddings``, ``layers.N.attention.wq``, ``norm``, ``output``), so FQNs in
logs and tests read the same as in those codebases. There is no FSDP code here:
the training script calls ``fully_shard`` on each entry of ``Llama.layers`` and
then on the root.

Determinism: the constructor ends with ``init_weights()``, so two models built
after the same ``torch.manual_seed`` are bit-identical. ``init_weights()`` can be
called again after ``to_empty(device=...)`` from the meta device; it also
recomputes the RoPE buffers, which ``to_empty`` leaves uninitialized.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

INIT_STD = 0.02


def swiglu_hidden_dim(dim: int, multiple_of: int = 64, multiplier: float = 1.0) -> int:
    """Llama's FFN width: 2/3 of 4 * dim (SwiGLU has three matrices, not two),
    scaled by ``multiplier`` and rounded up to ``multiple_of``."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model."""

    vocab_size: int
    """Number of token ids; rows of ``tok_embeddings`` and of ``output``."""
    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of ``TransformerBlock``s in ``Llama.layers``."""
    n_heads: int
    """Number of query heads; ``dim`` must be divisible by it."""
    n_kv_heads: int
    """Number of key/value heads; fewer than ``n_heads`` is grouped-query attention."""
    ffn_hidden_dim: int
    """Inner width of the SwiGLU feed-forward (see ``swiglu_hidden_dim``)."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon inside ``RMSNorm``."""
    tie_embeddings: bool = False
    """Whether ``output.weight`` is the same ``Parameter`` as ``tok_embeddings.weight``."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        """About 0.5M parameters: the default for CPU training runs and tests."""
        return cls(
            vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
            ffn_hidden_dim=swiglu_hidden_dim(128), max_seq_len=128,
        )

    @classmethod
    def small(cls) -> "LlamaConfig":
        """About 3.5M parameters: still fast on CPU, with more blocks to shard."""
        return cls(
            vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
            ffn_hidden_dim=swiglu_hidden_dim(256), max_seq_len=256,
        )

    @classmethod
    def llama_7b(cls) -> "LlamaConfig":
        """Llama-2 7B shapes (6.74B parameters); build on the meta device only."""
        return cls(
            vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
            ffn_hidden_dim=swiglu_hidden_dim(4096, multiple_of=256), max_seq_len=4096,
        )

    @classmethod
    def llama_70b(cls) -> "LlamaConfig":
        """Llama-2 70B shapes (68.98B parameters, GQA with 8 KV heads); meta device only."""
        return cls(
            vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
            ffn_hidden_dim=swiglu_hidden_dim(8192, multiple_of=4096, multiplier=1.3),
            max_seq_len=4096,
        )

    @classmethod
    def llama3_8b(cls) -> "LlamaConfig":
        """Llama-3 8B shapes (8.03B parameters: 128256 vocabulary, GQA with 8 KV heads,
        FFN 14336, RoPE base 500000), as Meta's params.json; meta device only."""
        return cls(
            vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            ffn_hidden_dim=swiglu_hidden_dim(4096, multiple_of=1024, multiplier=1.3),
            max_seq_len=8192, rope_theta=500000.0,
        )

    @classmethod
    def llama3_70b(cls) -> "LlamaConfig":
        """Llama-3 70B shapes (70.55B parameters, FFN 28672); meta device only."""
        return cls(
            vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
            ffn_hidden_dim=swiglu_hidden_dim(8192, multiple_of=4096, multiplier=1.3),
            max_seq_len=8192, rope_theta=500000.0,
        )

    @classmethod
    def llama3_405b(cls) -> "LlamaConfig":
        """Llama-3.1 405B shapes (405.85B parameters, 126 blocks, FFN 53248); meta only."""
        return cls(
            vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
            ffn_hidden_dim=swiglu_hidden_dim(16384, multiple_of=4096, multiplier=1.2),
            max_seq_len=8192, rope_theta=500000.0,
        )


PRESETS: dict[str, Callable[[], LlamaConfig]] = {
    "tiny": LlamaConfig.tiny,
    "small": LlamaConfig.small,
    "llama_7b": LlamaConfig.llama_7b,
    "llama_70b": LlamaConfig.llama_70b,
    # The plan CLI's names: Llama-2 7B is llama_7b, and Llama-3's.
    "llama2_7b": LlamaConfig.llama_7b,
    "llama3_8b": LlamaConfig.llama3_8b,
    "llama3_70b": LlamaConfig.llama3_70b,
    "llama3_405b": LlamaConfig.llama3_405b,
}


def rope_tables(config: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, each (max_seq_len, head_dim // 2), in fp32."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (
        -torch.arange(0, half, device=device, dtype=torch.float32) / half
    )  # (head_dim // 2,)
    positions = torch.arange(config.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, head_dim // 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head, as Llama's complex form does.

    x is (B, T, n_heads, head_dim); cos and sin are (T, head_dim // 2).
    """
    pairs = x.unflatten(-1, (-1, 2))  # (B, T, n_heads, head_dim // 2, 2)
    x_even, x_odd = pairs.unbind(-1)  # each (B, T, n_heads, head_dim // 2)
    cos = cos[:, None, :]  # (T, 1, head_dim // 2), broadcast over heads
    sin = sin[:, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)  # (B, T, n_heads, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=INIT_STD)
        nn.init.normal_(self.wo.weight, std=out_proj_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1, not n_heads: under tensor parallelism each rank holds n_heads / tp heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA wants heads before time: (B, n_heads, T, head_dim); k and v keep
        # n_kv_heads and enable_gqa broadcasts them, avoiding a repeat_interleave copy.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=k.shape[2] != q.shape[2],
        )  # (B, n_heads, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_proj_std: float) -> None:
        nn.init.normal_(self.w1.weight, std=INIT_STD)
        nn.init.normal_(self.w3.weight, std=INIT_STD)
        nn.init.normal_(self.w2.weight, std=out_proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block; the unit that the training script passes to ``fully_shard``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def init_weights(self, out_proj_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(out_proj_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(out_proj_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from the config, so they stay out of state_dict
        # (and out of checkpoints), and live on the root so every block shares one copy.
        cos, sin = rope_tables(config, self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic (given the RNG state) init of every parameter and buffer.

        Linear and embedding weights are N(0, 0.02); the projections that write into
        the residual stream (``attention.wo``, ``feed_forward.w2``) use 0.02 / sqrt(2 *
        n_layers) so the residual's variance does not grow with depth (GPT-2's scheme).
        Also restores the embedding tie if ``to_empty`` split it.
        """
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # to_empty() on a plain (not yet fully_shard-ed) meta model makes a new
            # Parameter per module, splitting the tied pair; DTensor params are swapped
            # in place instead, so after fully_shard this never fires.
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(self.config, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        out_proj_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            layer.init_weights(out_proj_std)
        self.norm.reset_parameters()
        # When tied, output.weight is tok_embeddings.weight: drawing it again would
        # consume RNG and overwrite the embedding init.
        if not self.config.tie_embeddings:
            nn.init.normal_(self.output.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map tokens (B, T) to next-token logits (B, T, vocab_size)."""
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}; "
                "build the model with a larger LlamaConfig.max_seq_len"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, head_dim // 2)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab_size)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; logits (B, T, vocab_size), targets (B, T)."""
    # Upcast so the log-softmax over the vocabulary is fp32 even when a mixed
    # precision policy makes the logits bf16.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence parallelism, in place.

    Attention and feed-forward projections are column-wise (wq, wk, wv, w1, w3) then
    row-wise (wo, w2) parallel; the norms run sequence-parallel on activations sharded
    on the sequence dim (dim 1); the embedding is row-wise parallel and the output head
    column-wise, gathering full logits. Call it before ``fully_shard``, with the
    ``tp`` sub-mesh of a ``(dp, tp)`` mesh. ``n_heads`` and ``n_kv_heads`` must be
    divisible by the TP size, and embeddings must be untied.
    """
    tp = tp_mesh.size()
    config = model.config
    if config.n_heads % tp or config.n_kv_heads % tp:
        raise ValueError(
            f"n_heads ({config.n_heads}) and n_kv_heads ({config.n_kv_heads}) must be "
            f"divisible by tp={tp}"
        )
    if config.tie_embeddings:
        raise ValueError("apply_tensor_parallel needs untied embeddings (tie_embeddings=False)")
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # x arrives sequence-sharded; cos and sin are plain full-length tables.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
