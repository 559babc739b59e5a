"""Where each streamed weight goes in the engine: `Target`, the name-mapping functions
(`NameMap`), and `llama_to_hf`, from ``models/llama.py``'s names to Hugging Face's
``LlamaForCausalLM`` (and vLLM's fused ``qkv_proj``/``gate_up_proj``).

A name map is a function of one trainer name (a state-dict key; for a peft model the
merged base-model name, see lora.py) that returns the engine's name (``str``), a
`Target` (a name with a rearrangement of the elements, or one part of a fused tensor),
or ``None`` to leave the weight out. It is called once per name, before anything is
gathered, so a mistake (two weights under one name, a fused part that does not exist)
is refused on every rank before any collective.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..models.llama import LlamaConfig


@dataclass(frozen=True)
class Target:
    """Where one trainer weight goes.

    The streamed value is ``rearrange(full)`` (or ``full``), cast to the stream's dtype;
    with ``fuse``, the engine's tensor ``name`` is the concatenation along ``fuse_dim`` of
    the rearranged values of the weights named in ``fuse``, in that order, and each of
    them maps to a `Target` with this same ``name``, ``fuse`` and ``fuse_dim``.
    """

    name: str
    """The engine's name for the weight (or for the fused tensor)."""
    rearrange: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Moves elements only (``view``, ``transpose``, ``reshape``, slicing): the stream may
    cast before it, which gives the same bits only for a rearrangement."""
    fuse: tuple[str, ...] = ()
    """The trainer names fused into ``name``, in order; empty: no fusion."""
    fuse_dim: int = 0
    """The dimension the fused parts are concatenated along."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Target.name must be a non-empty str, got {self.name!r}")
        if len(set(self.fuse)) != len(self.fuse):
            raise ValueError(f"Target {self.name!r}: fuse lists a name twice: {self.fuse}")


NameMap = Callable[[str], "str | Target | None"]
"""A trainer name to the engine's (``str``), a `Target`, or ``None`` (left out)."""


def same_names(name: str) -> str:
    """The default name map: every weight under its own name."""
    return name


def rope_pairs_to_halves(n_heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of a query or key projection from RoPE on adjacent pairs (Meta's Llama and
    ``models/llama.py``: ``x[2i], x[2i+1]``) to RoPE on halves (Hugging Face's
    ``rotate_half``: ``x[i], x[i + head_dim/2]``), per head: the permutation of
    transformers' ``convert_llama_weights_to_hf.py``. Moves rows only."""

    def rearrange(weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        # (n_heads, head_dim / 2, 2, in) -> (n_heads, 2, head_dim / 2, in): evens first
        pairs = weight.view(n_heads, out_features // n_heads // 2, 2, in_features)
        return pairs.transpose(1, 2).reshape(out_features, in_features)

    return rearrange


_BLOCK_NAMES = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def llama_to_hf(
    config: LlamaConfig, *, fuse_qkv: bool = False, fuse_gate_up: bool = False
) -> NameMap:
    """The name map from ``models/llama.py``'s ``Llama`` to Hugging Face's
    ``LlamaForCausalLM`` built from `hf_llama_config`: renamed, with the query and key
    rows permuted for Hugging Face's RoPE (`rope_pairs_to_halves`).

    Args:
        config: the trainer model's config (its head counts).
        fuse_qkv: stream each block's ``q_proj``, ``k_proj``, ``v_proj`` as one
            ``self_attn.qkv_proj.weight`` (rows concatenated), as vLLM's Llama holds them.
        fuse_gate_up: stream ``gate_proj`` and ``up_proj`` as one
            ``mlp.gate_up_proj.weight``, as vLLM's Llama holds them.

    Returns:
        A `NameMap`; names of another model raise ``KeyError`` (before any collective).
    """
    queries = rope_pairs_to_halves(config.n_heads)
    keys = rope_pairs_to_halves(config.n_kv_heads)

    def name_map(name: str) -> Target:
        if name in _TOP_NAMES:
            return Target(_TOP_NAMES[name])
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
            raise KeyError(f"llama_to_hf: {name!r} is not a models/llama.py Llama weight")
        prefix, rest = f"{parts[0]}.{parts[1]}.", parts[2]
        hf = f"model.{prefix}"
        if rest in _BLOCK_NAMES:
            return Target(hf + _BLOCK_NAMES[rest])
        attention = {"attention.wq.weight": ("q", queries), "attention.wk.weight": ("k", keys)}
        attention["attention.wv.weight"] = ("v", None)
        if rest in attention:
            letter, rearrange = attention[rest]
            if not fuse_qkv:
                return Target(f"{hf}self_attn.{letter}_proj.weight", rearrange)
            fused = tuple(f"{prefix}attention.w{x}.weight" for x in "qkv")
            return Target(f"{hf}self_attn.qkv_proj.weight", rearrange, fused)
        feed_forward = {"feed_forward.w1.weight": "gate", "feed_forward.w3.weight": "up"}
        if rest in feed_forward:
            if not fuse_gate_up:
                return Target(f"{hf}mlp.{feed_forward[rest]}_proj.weight")
            fused = (f"{prefix}feed_forward.w1.weight", f"{prefix}feed_forward.w3.weight")
            return Target(f"{hf}mlp.gate_up_proj.weight", None, fused)
        raise KeyError(f"llama_to_hf: {name!r} is not a models/llama.py Llama weight")

    return name_map


def hf_llama_config(config: LlamaConfig) -> dict[str, Any]:
    """The keyword arguments of ``transformers.LlamaConfig`` for the model `llama_to_hf`
    maps to (no import of transformers here: it stays optional)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
