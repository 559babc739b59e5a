"""An inference engine on the other side of a process group, 3 gloo ranks: ranks 0 and 1
train a tiny Hugging Face ``LlamaForCausalLM`` under ``fully_shard`` (2 AdamW steps);
rank 2, the engine, never trains: it builds the same model from the same config (with
other values), receives the weights that rank 0 streams (``stream_weights(rank=0)``
into ``send_buckets`` over a group of ranks 0 and 2, as vLLM's and SGLang's weight
updates do), loads them bucket by bucket and generates.

Checked: the engine's logits equal the trainer's full model's (a forward of the
sharded model on the same tokens) bitwise, and so do their greedy generations; the
engine loaded every weight of its model once; and an engine that loads torch's full
state dict (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) of
torch's ``fully_shard`` trained the same way computes the same logits.
"""

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.post_training import load_weights, receive_buckets, send_buckets, stream_weights
from tests._harness import run_distributed
from tests.integrations.test_hf_models import _build, _shard, _tokens
from tests.post_training._weights import train_hf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the [test] extra)",
)

WORLD_SIZE = 3  # two trainers, one engine
TRAINERS = [0, 1]
ENGINE = 2
STEPS = 2
NEW_TOKENS = 8
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6]]
BUCKET_MB = 0.02


def _trained(base: nn.Module, mesh: DeviceMesh, shard: Any) -> nn.Module:
    return train_hf(_shard(copy.deepcopy(base), mesh, shard), _tokens(), STEPS)


def _outputs(model: nn.Module) -> dict[str, Any]:
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
        # Greedy; the two trainers run the same steps, so no synced_gpus (which would
        # all-reduce over the default group, the engine included).
        tokens = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, synced_gpus=False
        )
    return {"logits": logits, "tokens": tokens[0].tolist()}


def _trainer(rank: int, engine_group: dist.ProcessGroup) -> dict[str, Any]:
    mesh = DeviceMesh("cpu", TRAINERS)
    base = _build("untied")
    ours, theirs = _trained(base, mesh, fully_shard), _trained(base, mesh, torch_fully_shard)
    buckets = stream_weights(ours, bucket_mb=BUCKET_MB, rank=0)
    reference = get_model_state_dict(
        theirs, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        send_buckets(buckets, group=engine_group, src=0)
        send_buckets([list(reference.items())], group=engine_group, src=0)
    else:
        assert list(buckets) == []  # rank 1 gathers with rank 0, and gets nothing
    return _outputs(ours)


def _engine(engine_group: dist.ProcessGroup) -> dict[str, Any]:
    engines = {}
    for name in ("ours", "torch"):
        engine = _build("untied").eval()
        with torch.no_grad():
            for param in engine.parameters():
                param.normal_()  # nothing of the trainer's values before the load
        loaded = []
        for bucket in receive_buckets(group=engine_group, src=0):
            loaded += load_weights(engine, bucket)
        engines[name] = engine
        expected = sorted(engine.state_dict())
        assert sorted(loaded) == expected, (sorted(loaded), expected)
    return {"ours": _outputs(engines["ours"]), "torch": _outputs(engines["torch"])}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    engine_group = dist.new_group([0, ENGINE])
    if rank == ENGINE:
        return _engine(engine_group)
    return _trainer(rank, engine_group)


@pytest.fixture(scope="module")
def run() -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=300)


def test_engine_logits_and_generation_equal_trainer(run: list[dict]) -> None:
    engine = run[ENGINE]["ours"]
    for trainer in (run[0], run[1]):
        assert torch.equal(engine["logits"], trainer["logits"])
        assert engine["tokens"] == trainer["tokens"]
    assert len(engine["tokens"]) == len(PROMPT[0]) + NEW_TOKENS


def test_engine_from_torch_full_state_dict_agrees(run: list[dict]) -> None:
    assert torch.equal(run[ENGINE]["torch"]["logits"], run[ENGINE]["ours"]["logits"])
    assert run[ENGINE]["torch"]["tokens"] == run[ENGINE]["ours"]["tokens"]
