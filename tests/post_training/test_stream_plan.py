"""What a weight stream will send, decided before any collective (in-process: a plain
model, or ``fully_shard`` on torch's fake process group, where nothing is gathered):
buckets within their size (a larger tensor alone), fused parts and tied names in one
bucket, FSDP groups in order; and every refusal, with the error type and a message
that names the weight and the fix. A plain model streams without a process group.
"""

import importlib.util

import pytest
import torch
from torch import nn

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig
from dtensor_fsdp.post_training import (
    PARAM_DTYPE,
    Target,
    keep_unsharded,
    llama_to_hf,
    load_weights,
    offload_states,
    stream_weights,
)
from dtensor_fsdp.post_training.plan import plan_stream
from tests._harness import fake_mesh
from tests.post_training._weights import collect, differing, mapped

CONFIG = LlamaConfig(
    vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=16
)
MIB = 1 << 20


def _llama(**changes: object) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**CONFIG.__dict__, **changes}))


def _bucket_names(model: nn.Module, bucket_mb: float, **kwargs: object) -> list[list[str]]:
    plan = plan_stream(model, int(bucket_mb * MIB), None, kwargs.get("name_map", str), True)
    return [[o.name for unit in bucket for o in unit.outputs] for bucket in plan.buckets]


def test_plain_model_streams_its_state_dict_in_buckets() -> None:
    model = _llama()
    bucket_bytes = 0.02 * MIB
    buckets = [[(n, t.clone()) for n, t in b] for b in stream_weights(model, bucket_mb=0.02)]
    for bucket in buckets:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert nbytes <= bucket_bytes or len(bucket) == 1, [n for n, _ in bucket]
    assert len(buckets) > 3
    got = {n: t for b in buckets for n, t in b}
    assert differing(got, model.state_dict()) == []
    low = collect(stream_weights(model, dtype=torch.bfloat16))
    assert differing(low, mapped(model.state_dict(), dtype=torch.bfloat16)) == []
    assert differing(collect(stream_weights(model, dtype=PARAM_DTYPE)), model.state_dict()) == []


def test_fused_parts_and_tied_names_share_a_bucket() -> None:
    name_map = llama_to_hf(CONFIG, fuse_qkv=True, fuse_gate_up=True)
    buckets = _bucket_names(_llama(tie_embeddings=True), 1e-6, name_map=name_map)
    # The smallest buckets hold one unit: the tied pair, or one fused tensor.
    assert ["model.embed_tokens.weight", "lm_head.weight"] in buckets
    assert ["model.layers.0.self_attn.qkv_proj.weight"] in buckets
    assert ["model.layers.1.mlp.gate_up_proj.weight"] in buckets


def test_fsdp_groups_in_order() -> None:
    with fake_mesh(2) as mesh:
        model = _llama()
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        order = [name for bucket in _bucket_names(model, 1e-6) for name in bucket]
    root = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    blocks = [n for n in model.state_dict() if n.startswith("layers.")]
    assert sorted(order[:3]) == sorted(root) and order[3:] == blocks


def _two_to_one(name: str) -> str:
    return "same" if name.endswith("wq.weight") else name


def _fuse_missing(name: str) -> Target | str:
    if name == "layers.0.attention.wq.weight":
        return Target("qkv", fuse=("layers.0.attention.wq.weight", "layers.0.attention.wz.weight"))
    return name


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bucket_mb": 0}, ValueError, "bucket_mb must be a positive number"),
        ({"dtype": torch.int8}, ValueError, "floating-point torch.dtype or 'param_dtype'"),
        ({"rank": 3}, ValueError, "rank must be None or a global rank < 1"),
        (
            {"name_map": lambda name: 7},
            TypeError,
            r"name_map\('tok_embeddings.weight'\) returned int",
        ),
        ({"name_map": _two_to_one}, ValueError, "all to 'same'"),
        (
            {"name_map": _fuse_missing},
            ValueError,
            r"\['layers.0.attention.wz.weight'\] are not weights",
        ),
        ({"name_map": llama_to_hf(LlamaConfig.tiny())}, None, None),
    ],
)
def test_refused_before_anything_is_gathered(kwargs: dict, error: type, match: str) -> None:
    model = _llama()
    if error is None:  # a map of another config's shapes still names every weight
        stream_weights(model, **kwargs)
        return
    with pytest.raises(error, match=match):
        stream_weights(model, **kwargs)


def test_llama_to_hf_refuses_other_names() -> None:
    with pytest.raises(KeyError, match="'encoder.weight' is not a models/llama.py Llama weight"):
        llama_to_hf(CONFIG)("encoder.weight")


def test_meta_weights_refused() -> None:
    with torch.device("meta"):
        model = Llama(CONFIG)
    with pytest.raises(ValueError, match="on the meta device: materialize the model"):
        stream_weights(model)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_dora_refused() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["wq"], use_dora=True))
    with pytest.raises(NotImplementedError, match="not plain LoRA on a Linear"):
        stream_weights(model)
    assert len(list(stream_weights(model, merge_lora=False))) == 1


def test_load_weights_refuses_unknown_names_and_shapes() -> None:
    model = nn.Linear(2, 3)
    assert load_weights(model, [("weight", torch.ones(3, 2))]) == ["weight"]
    assert torch.equal(model.weight, torch.ones(3, 2))
    with pytest.raises(KeyError, match="has no parameter or persistent buffer 'w'"):
        load_weights(model, [("w", torch.ones(3, 2))])
    with pytest.raises(ValueError, match=r"'bias' has shape \(2,\), the module's \(3,\)"):
        load_weights(model, [("bias", torch.ones(2))])


def test_not_fully_shard_modules_refused() -> None:
    model = nn.Linear(2, 3)
    with pytest.raises(ValueError, match="is not a fully_shard module"), keep_unsharded(model):
        pass
    with pytest.raises(ValueError, match="has no fully_shard group"):
        offload_states(model)
