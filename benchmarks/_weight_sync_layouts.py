"""``bench_weight_sync.py``'s bitwise check: for each layout, every tensor of
``stream_weights`` against torch's ``get_model_state_dict(full_state_dict=True)`` of the
same model with the same mapping (names, fusion, cast, LoRA merge) applied by
``tests/post_training/_weights.mapped``. Meshes with two axes are (2, W/2) from 4 ranks
on, both (1, W) and (W, 1) below.
"""

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common.workload import shard_blocks_then_root
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel
from dtensor_fsdp.post_training import PARAM_DTYPE, llama_to_hf, stream_weights
from tests.integrations._moe import MoEConfig, apply_expert_parallel
from tests.integrations._moe import build as build_moe
from tests.integrations._titan_fsdp import apply_fsdp_to_decoder, titan_meshes
from tests.integrations.test_moe import IMPLS
from tests.post_training._weights import collect, differing, full_state_dict, mapped

BUCKET_MB = 0.05
BF16 = torch.bfloat16


def _config(**changes: Any) -> LlamaConfig:
    # An uneven vocabulary, heads that any TP size up to 4 divides.
    base = {"vocab_size": 67, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
            "ffn_hidden_dim": 128, "max_seq_len": 16}  # fmt: skip
    return LlamaConfig(**{**base, **changes})


def _llama(config: LlamaConfig, mesh: DeviceMesh, **kwargs: Any) -> Llama:
    torch.manual_seed(0)
    model = Llama(config)
    return shard_blocks_then_root(model, fully_shard, mesh=mesh, **kwargs)


def _two_axes(world_size: int) -> list[tuple[int, int]]:
    if world_size >= 4 and world_size % 2 == 0:
        return [(2, world_size // 2)]
    return [(1, world_size), (world_size, 1)]


def _tp(config: LlamaConfig, shape: tuple[int, int]) -> Llama:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(config)
    apply_tensor_parallel(model, mesh["tp"])
    return shard_blocks_then_root(model, fully_shard, mesh=mesh["dp"])


def _moe(world_size: int) -> nn.Module:
    meshes = titan_meshes(world_size, 2)
    model = build_moe(MoEConfig(num_experts=4, top_k=1), seed=0)
    apply_expert_parallel(model, meshes.ep)
    apply_fsdp_to_decoder(
        model, meshes.dp, IMPLS["ours"], torch.float32, torch.float32, 2, meshes.efsdp
    )
    return model


def _lora() -> tuple[nn.Module, nn.Module]:
    """A tiny Hugging Face Llama with peft LoRA on q/v, merged by the stream; the
    reference is peft's merge_and_unload() of an unsharded copy."""
    from tests.integrations.test_hf_models import _build, _decoder_layers

    base = _build("lora")
    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), base


def _check(model: nn.Module, reference: dict[str, torch.Tensor], **kwargs: Any) -> list[str]:
    return differing(collect(stream_weights(model, bucket_mb=BUCKET_MB, **kwargs)), reference)


def layouts(world_size: int) -> dict[str, Callable[[], list[str]]]:
    """Each layout's check: the names that differ (empty: bitwise)."""
    config = _config()
    flat = init_device_mesh("cpu", (world_size,))
    checks: dict[str, Callable[[], list[str]]] = {}

    def plain(model_fn: Callable[[], nn.Module], **kwargs: Any) -> Callable[[], list[str]]:
        def check() -> list[str]:
            model = model_fn()
            dtype = kwargs.get("dtype")
            reference = mapped(full_state_dict(model), kwargs.get("name_map"),
                               BF16 if dtype == PARAM_DTYPE else dtype)  # fmt: skip
            return _check(model, reference, **kwargs)

        return check

    checks[f"fsdp W={world_size}"] = plain(lambda: _llama(config, flat))
    names = ("replicate", "shard")
    for shape in _two_axes(world_size):
        checks[f"hsdp {shape}"] = plain(
            lambda s=shape: _llama(config, init_device_mesh("cpu", s, mesh_dim_names=names))
        )
        checks[f"fsdp x tp {shape}"] = plain(lambda s=shape: _tp(_config(vocab_size=64), s))
    if world_size % 2 == 0:
        checks["expert parallel (ep=2)"] = plain(lambda: _moe(world_size))
    checks["tied"] = plain(lambda: _llama(_config(tie_embeddings=True), flat))
    offload = CPUOffloadPolicy(pin_memory=False)
    checks["cpu offload"] = plain(lambda: _llama(config, flat, offload_policy=offload))
    mp = MixedPrecisionPolicy(param_dtype=BF16)
    checks["mixed precision, masters"] = plain(lambda: _llama(config, flat, mp_policy=mp))
    checks["mixed precision, param_dtype"] = plain(
        lambda: _llama(config, flat, mp_policy=mp), dtype=PARAM_DTYPE
    )
    hf_map = llama_to_hf(config, fuse_qkv=True, fuse_gate_up=True)
    checks["llama_to_hf fused, bf16"] = plain(
        lambda: _llama(config, flat), name_map=hf_map, dtype=BF16
    )
    checks["peft LoRA merged"] = _lora_check
    return checks


def _lora_check() -> list[str]:
    model, base = _lora()
    unsharded = copy.deepcopy(base)
    unsharded.load_state_dict(full_state_dict(model))
    return _check(model, unsharded.merge_and_unload().state_dict())
