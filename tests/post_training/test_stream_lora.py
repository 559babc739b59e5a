"""``stream_weights`` of a peft LoRA model (a tiny Hugging Face ``LlamaForCausalLM``,
LoRA on ``q_proj``/``v_proj``, trained 2 steps under ``fully_shard``) on 2 gloo ranks:
merged weights under the merged model's names, without the trainer's parameters being
touched.

References, bitwise: peft's own ``merge_and_unload()`` of an unsharded copy that loaded
torch's full state dict (``get_model_state_dict(full_state_dict=True)``) of our model,
and the same of torch's ``fully_shard`` trained the same way; in fp32 and cast to bf16
after merging. The trainer's local shards are bitwise what they were before streaming,
and its adapters stay unmerged (its logits are unchanged). ``merge_lora=False`` streams
the state dict's own names, adapters included.
"""

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.post_training import stream_weights
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests.integrations.test_hf_models import _build, _shard, _tokens
from tests.post_training._weights import collect, differing, full_state_dict, mapped, train_hf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs transformers and peft (the [test] extra)",
)

WORLD_SIZE = 2
STEPS = 2
BUCKET_MB = 0.02


def _trained(base: nn.Module, shard: Any) -> nn.Module:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    return train_hf(_shard(copy.deepcopy(base), mesh, shard), _tokens(), STEPS)


def _peft_merged(base: nn.Module, sharded: nn.Module) -> dict[str, torch.Tensor]:
    """peft's merge of an unsharded copy holding ``sharded``'s full weights."""
    unsharded = copy.deepcopy(base)
    unsharded.load_state_dict(full_state_dict(sharded))
    return unsharded.merge_and_unload().state_dict()


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _merge() -> dict[str, Any]:
    base = _build("lora")
    ours, theirs = _trained(base, fully_shard), _trained(base, torch_fully_shard)
    shards, tokens = _locals(ours), _tokens()
    with torch.no_grad():
        logits = ours(input_ids=tokens).logits
    merged = collect(stream_weights(ours, bucket_mb=BUCKET_MB))
    low = collect(stream_weights(ours, bucket_mb=BUCKET_MB, dtype=torch.bfloat16))
    raw = collect(stream_weights(ours, bucket_mb=BUCKET_MB, merge_lora=False))
    with torch.no_grad():
        logits_after = ours(input_ids=tokens).logits
    reference = _peft_merged(base, ours)
    return {
        "vs_peft": differing(merged, reference),
        "vs_torch": differing(merged, _peft_merged(base, theirs)),
        "bf16": differing(low, mapped(reference, dtype=torch.bfloat16)),
        "raw": differing(raw, full_state_dict(ours)),
        "shards_kept": differing(_locals(ours), shards),
        "logits_kept": torch.equal(logits, logits_after),
        "lora_trained": any(
            "lora_B" in n and p.to_local().abs().sum() > 0 for n, p in ours.named_parameters()
        ),
        "names": sorted(merged),
    }


def _worker(rank: int, world_size: int) -> dict:
    return run_scenarios({"merge": _merge})


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=300, pool=gloo_pool)


def test_merged_weights_equal_peft_merge(run: list[dict]) -> None:
    for record in scenario_records(run, "merge"):
        assert record["vs_peft"] == [] and record["vs_torch"] == [] and record["bf16"] == []
        assert record["raw"] == [], record["raw"]
        assert record["lora_trained"]
        assert not any("lora" in n or "base_layer" in n for n in record["names"])
        assert "model.layers.0.self_attn.q_proj.weight" in record["names"]


def test_trainer_parameters_untouched(run: list[dict]) -> None:
    for record in scenario_records(run, "merge"):
        assert record["shards_kept"] == [] and record["logits_kept"], record
