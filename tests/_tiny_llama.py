"""The repo's Llama in the tiny shapes several tests share (init, plan).

- ``uneven_config(tie)``: 2 blocks of dim 32 and a 97-row vocabulary, which is uneven
  over 2 ranks: the last shard of the embedding (and output) is padded.
- ``frozen_tiny_llama(*fqns)``: a builder of ``LlamaConfig.tiny()``'s model with the
  modules ``fqns`` frozen, as a fine-tuning job freezes them.
"""

from collections.abc import Callable

from dtensor_fsdp.models.llama import Llama, LlamaConfig


def uneven_config(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=88,
        max_seq_len=16,
        tie_embeddings=tie,
    )


def frozen_tiny_llama(*fqns: str) -> Callable[[], Llama]:
    def build() -> Llama:
        model = Llama(LlamaConfig.tiny())
        for fqn in fqns:
            model.get_submodule(fqn).requires_grad_(False)
        return model

    return build
