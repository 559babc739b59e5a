"""``stream_weights`` on 2 gloo ranks: every streamed tensor bitwise equals torch's full
state dict (``get_model_state_dict(full_state_dict=True)``) of the same model, both
ours and torch's ``fully_shard`` of it, with the same name map, fusion and cast applied
(``_weights.mapped``), for each layout: FSDP (uneven shards), HSDP on (1, 2) and
(2, 1) meshes, FSDP x TP on (1, 2) and (2, 1), ``Shard(1)`` parameters, tied
embeddings, CPU offload, mixed precision (the fp32 masters, and ``param_dtype``:
equal to the unsharded params FSDP computes with, ours and torch's), expert
parallelism (torchtitan's meshes and calls: experts sharded over EP=2, and experts on
dim 1 without EP), after a training step.
With 2 ranks one axis of each 2-D mesh has size 1; ``bench_weight_sync.py`` runs the
same comparison at W=4 on 2x2 meshes.

The stream of torch's ``fully_shard`` model (parameters dtensor_fsdp does not manage:
one ``full_tensor()`` each) equals its full state dict too.

Also: ``llama_to_hf`` (names, RoPE rows, vLLM's fused ``qkv_proj`` and
``gate_up_proj``) loads into Hugging Face's ``LlamaForCausalLM`` whose logits equal
ours to fp32 rounding; the stream moves the same bytes as torch's full state dict
(counted at the c10d level), holds at most two buckets plus one tensor of live
memory, empties each bucket when the next is asked for, with ``rank=0`` gives rank 1
nothing, and leaves the model as it was (unsharded groups stay unsharded).
"""

import importlib.util
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

from dtensor_fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel
from dtensor_fsdp.post_training import (
    PARAM_DTYPE,
    hf_llama_config,
    llama_to_hf,
    load_weights,
    stream_weights,
)
from tests._c10d import C10dRecorder, bytes_of
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests.integrations._moe import MoEConfig, apply_expert_parallel
from tests.integrations._moe import build as build_moe
from tests.integrations._titan_fsdp import apply_fsdp_to_decoder, titan_meshes
from tests.integrations.test_moe import IMPLS
from tests.post_training._weights import LiveBytes, collect, differing, full_state_dict, mapped

WORLD_SIZE = 2
BUCKET_MB = 0.02  # ~20 KB: several buckets for the test model
# Uneven over 2 ranks: vocab 67 rows; n_kv_heads 2 so that TP over 2 divides.
CONFIG = LlamaConfig(
    vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=16
)
TP_CONFIG = LlamaConfig(**{**CONFIG.__dict__, "vocab_size": 64})
TIED_CONFIG = LlamaConfig(**{**CONFIG.__dict__, "tie_embeddings": True})
BF16 = torch.bfloat16


class Impl:
    """ours or torch's fully_shard, with its own policy classes."""

    def __init__(self, name: str) -> None:
        ours = name == "ours"
        self.fully_shard = fully_shard if ours else torch_fully_shard
        self.mp = MixedPrecisionPolicy if ours else TorchMixedPrecisionPolicy
        self.offload = CPUOffloadPolicy if ours else TorchCPUOffloadPolicy


def _llama(config: LlamaConfig) -> Llama:
    torch.manual_seed(0)
    return Llama(config)


def _shard_blocks(model: Llama, impl: Impl, **kwargs: Any) -> Llama:
    for block in model.layers:
        impl.fully_shard(block, **kwargs)
    impl.fully_shard(model, **kwargs)
    return model


def _fsdp(impl: Impl, **kwargs: Any) -> Llama:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    return _shard_blocks(_llama(kwargs.pop("config", CONFIG)), impl, mesh=mesh, **kwargs)


def _hsdp(impl: Impl, shape: tuple[int, int]) -> Llama:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return _shard_blocks(_llama(CONFIG), impl, mesh=mesh)


def _tp(impl: Impl, shape: tuple[int, int]) -> Llama:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = _llama(TP_CONFIG)
    apply_tensor_parallel(model, mesh["tp"])
    return _shard_blocks(model, impl, mesh=mesh["dp"])


def _moe(impl_name: str, ep: int, experts: int) -> nn.Module:
    """torchtitan's MoE decoder under its EP and FSDP calls (tests/integrations); with
    one expert per rank or fewer, torchtitan shards the experts on dim 1."""
    meshes = titan_meshes(WORLD_SIZE, ep)
    model = build_moe(MoEConfig(num_experts=experts, top_k=1), seed=0)
    if ep > 1:
        apply_expert_parallel(model, meshes.ep)
    impl = IMPLS[impl_name]
    apply_fsdp_to_decoder(model, meshes.dp, impl, torch.float32, torch.float32, ep, meshes.efsdp)
    return model


def _dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


LAYOUTS: dict[str, Callable[[str], nn.Module]] = {
    "fsdp": lambda i: _fsdp(Impl(i)),
    "hsdp_1x2": lambda i: _hsdp(Impl(i), (1, 2)),
    "hsdp_2x1": lambda i: _hsdp(Impl(i), (2, 1)),
    "tp_1x2": lambda i: _tp(Impl(i), (1, 2)),
    "tp_2x1": lambda i: _tp(Impl(i), (2, 1)),
    "shard_dim1": lambda i: _fsdp(Impl(i), shard_placement_fn=_dim1),
    "tied": lambda i: _fsdp(Impl(i), config=TIED_CONFIG),
    "cpu_offload": lambda i: _fsdp(Impl(i), offload_policy=Impl(i).offload(pin_memory=False)),
    "ep_experts_dim0": lambda i: _moe(i, ep=2, experts=4),
    "experts_dim1": lambda i: _moe(i, ep=1, experts=1),
}


def _layout(name: str) -> dict[str, list[str]]:
    """Our stream against torch's full state dict of ours and of torch's model."""
    ours, theirs = LAYOUTS[name]("ours"), LAYOUTS[name]("torch")
    streamed = collect(stream_weights(ours, bucket_mb=BUCKET_MB))
    reference = full_state_dict(theirs)
    return {
        "vs_ours": differing(streamed, full_state_dict(ours)),
        "vs_torch": differing(streamed, reference),
        "buckets": len(list(stream_weights(ours, bucket_mb=BUCKET_MB))) > 2,
        # Parameters dtensor_fsdp does not manage: full_tensor() each.
        "torch_model": differing(collect(stream_weights(theirs, bucket_mb=BUCKET_MB)), reference),
    }


def _after_step() -> dict[str, list[str]]:
    """After an AdamW step on each: streams the updated values; ours = torch's."""
    models = {impl: _fsdp(Impl(impl)) for impl in ("ours", "torch")}
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=_rank_generator())
    for model in models.values():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(tokens[:, :-1]).float().pow(2).mean().backward()
        optimizer.step()
    streamed = collect(stream_weights(models["ours"], bucket_mb=BUCKET_MB))
    return {
        "vs_ours": differing(streamed, full_state_dict(models["ours"])),
        "vs_torch": differing(streamed, full_state_dict(models["torch"])),
        "changed": not torch.equal(streamed["norm.weight"], torch.ones(CONFIG.dim)),
    }


def _rank_generator() -> torch.Generator:
    return torch.Generator().manual_seed(10 + dist.get_rank())


def _mixed_precision() -> dict[str, list[str]]:
    """fp32 masters by default; param_dtype on request, which is what FSDP computes
    with: the unsharded params after ``unshard()``, ours and torch's."""
    out = {}
    models = {i: _fsdp(Impl(i), mp_policy=Impl(i).mp(param_dtype=BF16)) for i in ("ours", "torch")}
    reference = full_state_dict(models["torch"])
    out["masters"] = differing(collect(stream_weights(models["ours"])), reference)
    low = collect(stream_weights(models["ours"], bucket_mb=BUCKET_MB, dtype=PARAM_DTYPE))
    out["param_dtype"] = differing(low, mapped(reference, dtype=BF16))
    for impl, model in models.items():
        modules = [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]
        for module in modules:
            module.unshard()
        unsharded = {n: p.detach().clone() for n, p in model.named_parameters()}
        for module in modules:
            module.reshard()
        out[f"unsharded_{impl}"] = differing(low, unsharded)
    return out


def _hf_names() -> dict[str, Any]:
    """llama_to_hf: bitwise the mapped reference; loaded into LlamaForCausalLM, whose
    logits equal ours to fp32 rounding (a different RoPE formula and head order)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    model = _fsdp(Impl("ours"))
    reference = full_state_dict(model)
    out: dict[str, Any] = {}
    for fused in (False, True):
        name_map = llama_to_hf(CONFIG, fuse_qkv=fused, fuse_gate_up=fused)
        for dtype in (None, BF16):
            got = collect(
                stream_weights(model, bucket_mb=BUCKET_MB, dtype=dtype, name_map=name_map)
            )
            out[f"fused={fused} dtype={dtype}"] = differing(got, mapped(reference, name_map, dtype))
    torch.manual_seed(5)
    engine = LlamaForCausalLM(HFConfig(**hf_llama_config(CONFIG), attn_implementation="sdpa"))
    for bucket in stream_weights(model, bucket_mb=BUCKET_MB, name_map=llama_to_hf(CONFIG)):
        load_weights(engine, bucket)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours, hf = model(tokens), engine(tokens).logits
    out["logits_max_diff"] = (ours - hf).abs().max().item()
    out["logits_max"] = ours.abs().max().item()
    return out


def _bytes_and_memory() -> dict[str, Any]:
    """What a stream moves and holds: the bytes torch's full state dict all-gathers
    (counted at the c10d level), at most two buckets and one tensor of live memory,
    and each bucket freed once the next one is asked for."""
    ours, theirs = _fsdp(Impl("ours")), _fsdp(Impl("torch"))
    with C10dRecorder() as ours_rec:
        collect(stream_weights(ours, bucket_mb=BUCKET_MB))
    with C10dRecorder() as torch_rec:
        full_state_dict(theirs)
    largest = max(p.numel() * p.element_size() for p in ours.parameters())
    bucket = int(BUCKET_MB * 2**20)
    live = LiveBytes()
    freed = []
    with live:
        previous: list[torch.Tensor] = []
        for bucket_pairs in stream_weights(ours, bucket_mb=BUCKET_MB):
            freed.append(all(_is_dead(ref) for ref in previous))
            previous = [_storage_ref(t) for _, t in bucket_pairs]
    return {
        "ours_bytes": bytes_of(ours_rec.records, "broadcast"),
        "torch_bytes": bytes_of(torch_rec.records, "all_gather"),
        "ours_kinds": sorted({kind for kind, _ in ours_rec.records}),
        "peak": live.peak,
        "bound": 2 * bucket + largest,
        "freed": freed,
    }


def _storage_ref(tensor: torch.Tensor) -> Any:
    return weakref.ref(tensor.untyped_storage())


def _is_dead(ref: Any) -> bool:
    return ref() is None


def _one_rank_and_state() -> dict[str, Any]:
    """``rank=0``: rank 1 gathers with rank 0 but gets nothing. The root kept
    unsharded after a no_grad forward stays so, the blocks stay sharded."""
    model = _fsdp(Impl("ours"))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    before = {n: type(p).__name__ for n, p in model.named_parameters()}
    got = collect(stream_weights(model, bucket_mb=BUCKET_MB, rank=0))
    after = {n: type(p).__name__ for n, p in model.named_parameters()}
    return {"names": sorted(got), "types_kept": before == after, "before": before}


def _worker(rank: int, world_size: int) -> dict:
    scenarios = {name: (lambda name=name: _layout(name)) for name in LAYOUTS}
    scenarios.update(
        after_step=_after_step,
        mixed_precision=_mixed_precision,
        bytes_and_memory=_bytes_and_memory,
        one_rank_and_state=_one_rank_and_state,
    )
    if importlib.util.find_spec("transformers") is not None:
        scenarios["hf_names"] = _hf_names
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=300, pool=gloo_pool)


@pytest.mark.parametrize("layout", [*LAYOUTS, "after_step"])
def test_stream_equals_full_state_dict(run: list[dict], layout: str) -> None:
    for record in scenario_records(run, layout):
        assert record["vs_ours"] == [] and record["vs_torch"] == [], record
        assert record.get("torch_model", []) == [], record
        assert record.get("buckets", True) and record.get("changed", True)


def test_mixed_precision_masters_or_param_dtype(run: list[dict]) -> None:
    for record in scenario_records(run, "mixed_precision"):
        assert all(v == [] for v in record.values()), record


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_llama_to_hf_names_fusion_and_logits(run: list[dict]) -> None:
    for record in scenario_records(run, "hf_names"):
        logits = (record.pop("logits_max_diff"), record.pop("logits_max"))
        assert all(v == [] for v in record.values()), record
        # Two fp32 computations of the same function (RoPE angles by another formula,
        # heads in another order): a few ulps of the largest logit.
        assert logits[0] <= 2**-20 * max(1.0, logits[1]), logits


def test_same_bytes_as_torch_two_buckets_alive(run: list[dict]) -> None:
    for record in scenario_records(run, "bytes_and_memory"):
        assert record["ours_bytes"] == record["torch_bytes"] > 0, record
        assert record["ours_kinds"] == ["broadcast"], record
        assert 0 < record["peak"] <= record["bound"], record
        assert all(record["freed"]) and len(record["freed"]) > 2, record


def test_one_rank_gets_the_buckets_model_kept(run: list[dict]) -> None:
    ranks = scenario_records(run, "one_rank_and_state")
    names = sorted(n.replace(".weight", "") for n in ranks[0]["names"])
    assert len(names) == 3 + 9 * CONFIG.n_layers and ranks[1]["names"] == []
    for record in ranks:
        assert record["types_kept"], record
        assert record["before"]["output.weight"] == "Parameter"  # the root kept unsharded
        assert record["before"]["layers.0.attention.wq.weight"] == "DTensor"
