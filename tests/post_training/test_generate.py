"""Generation on the trainer, 2 gloo ranks: Hugging Face ``generate()`` of a 4-layer
``LlamaForCausalLM`` (5 groups: every decoder layer, then the root), 32 new tokens,
all-gathers counted at the c10d level, ours and torch's ``fully_shard`` on the same
script.

- Plain ``generate()``: 129 all-gathers, ours and torch's (the root is gathered once and
  kept; each layer at every token). The root's ``unshard()`` first changes nothing.
- torch's workaround (``set_reshard_after_forward(False)`` on the root, then
  ``reshard()`` of every FSDP module): 5, and ``reshard_after_forward`` stays False.
- Ours, ``keep_unsharded(model)``: 5, in ``no_grad`` and in ``inference_mode``; the
  same tokens as the unsharded model; on exit every group is sharded again and its
  settings are as before (``describe_groups``); the next training step's loss, grads
  and all-gathers equal those of a model that never generated. An exception inside
  restores it too.
"""

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import FSDPModule, fully_shard
from dtensor_fsdp.post_training import keep_unsharded
from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the [test] extra)",
)

WORLD_SIZE = 2
LAYERS = 4
NEW_TOKENS = 32
PROMPT = [[5, 6, 7, 8]]


def _base() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _sharded(base: nn.Module, shard: Any) -> nn.Module:
    mesh: DeviceMesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        shard(layer, mesh=mesh)
    return shard(model, mesh=mesh)


def _generate(model: nn.Module) -> tuple[list[int], int]:
    """Greedy tokens (exactly NEW_TOKENS new ones) and the all-gathers issued."""
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    with C10dRecorder() as recorder:
        tokens = model.generate(torch.tensor(PROMPT), pad_token_id=0, **kwargs)[0].tolist()
    return tokens, count_of(recorder.records, "all_gather")


def _fsdp_modules(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def _torch_workaround(model: nn.Module) -> tuple[list[int], int]:
    model.set_reshard_after_forward(False)
    tokens, count = _generate(model)
    with C10dRecorder() as recorder:  # resharding issues nothing: asserted
        for module in _fsdp_modules(model):
            module.reshard()
    return tokens, count + len(recorder.records)


def _root_unshard_first(model: nn.Module) -> tuple[list[int], int]:
    with C10dRecorder() as recorder:
        model.unshard()
    tokens, count = _generate(model)
    return tokens, count + count_of(recorder.records, "all_gather")


def _keep(grad_mode: Callable[[], Any]) -> Callable[[nn.Module], tuple[list[int], int]]:
    def run(model: nn.Module) -> tuple[list[int], int]:
        with grad_mode(), keep_unsharded(model):
            return _generate(model)

    return run


def _counts() -> dict[str, Any]:
    base = _base()
    with torch.no_grad():
        out: dict[str, Any] = {"reference": _generate(base)[0]}
    runs = {
        "ours_plain": (fully_shard, lambda m: _generate(m)),
        "torch_plain": (torch_fully_shard, lambda m: _generate(m)),
        "ours_root_unshard": (fully_shard, _root_unshard_first),
        "torch_root_unshard": (torch_fully_shard, _root_unshard_first),
        "torch_workaround": (torch_fully_shard, _torch_workaround),
        "ours_keep_no_grad": (fully_shard, _keep(torch.no_grad)),
        "ours_keep_inference_mode": (fully_shard, _keep(torch.inference_mode)),
    }
    for name, (shard, generate) in runs.items():
        out[name] = generate(_sharded(base, shard))
    return out


def _train_step(model: nn.Module) -> dict[str, Any]:
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with C10dRecorder() as recorder:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    return {
        "loss": loss.item(),
        "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
        "all_gathers": count_of(recorder.records, "all_gather"),
    }


def _model_as_before() -> dict[str, Any]:
    """Three models after one training step (so past lazy init): one generates inside
    keep_unsharded, one raises inside it, one does neither; then a training step each."""
    base = _base()
    fresh, used, failed = (_sharded(base, fully_shard) for _ in range(3))
    for model in (fresh, used, failed):
        _train_step(model)
        model.zero_grad(set_to_none=True)
    settings = [g.reshard_after_forward for g in used.describe_groups()]
    with torch.no_grad(), keep_unsharded(used):
        _generate(used)
    try:
        with torch.no_grad(), keep_unsharded(failed):
            failed(input_ids=torch.tensor(PROMPT))
            raise KeyError("inside")
    except KeyError:
        pass
    out: dict[str, Any] = {}
    for name, model in (("used", used), ("failed", failed)):
        out[f"{name}_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        out[f"{name}_settings"] = [g.reshard_after_forward for g in model.describe_groups()]
    out["settings"] = settings
    out["steps"] = {name: _train_step(m) for name, m in (("fresh", fresh), ("used", used))}
    # torch's workaround leaves reshard_after_forward=False: its next training step
    # all-gathers the layers in forward only.
    torch_fresh, torch_used = (_sharded(base, torch_fully_shard) for _ in range(2))
    _torch_workaround(torch_used)
    out["torch_all_gathers"] = {
        "fresh": _train_step(torch_fresh)["all_gathers"],
        "used": _train_step(torch_used)["all_gathers"],
    }
    return out


def _worker(rank: int, world_size: int) -> dict:
    return run_scenarios({"counts": _counts, "model_as_before": _model_as_before})


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=300, pool=gloo_pool)


def test_all_gathers_per_generate(run: list[dict]) -> None:
    groups = LAYERS + 1
    expected = {
        "ours_plain": 1 + LAYERS * NEW_TOKENS,  # 129
        "torch_plain": 1 + LAYERS * NEW_TOKENS,
        "ours_root_unshard": 1 + LAYERS * NEW_TOKENS,
        "torch_root_unshard": 1 + LAYERS * NEW_TOKENS,
        "torch_workaround": groups,  # 5
        "ours_keep_no_grad": groups,
        "ours_keep_inference_mode": groups,
    }
    for record in scenario_records(run, "counts"):
        for name, count in expected.items():
            tokens, got = record[name]
            assert got == count, (name, got, count)
            assert tokens == record["reference"], name
        assert len(record["reference"]) == len(PROMPT[0]) + NEW_TOKENS


def test_model_as_before_and_trains_the_same(run: list[dict]) -> None:
    for record in scenario_records(run, "model_as_before"):
        assert record["used_sharded"] and record["failed_sharded"]
        assert record["used_settings"] == record["settings"] == record["failed_settings"]
        fresh, used = record["steps"]["fresh"], record["steps"]["used"]
        assert fresh["loss"] == used["loss"]
        assert fresh["all_gathers"] == used["all_gathers"] == 1 + 2 * LAYERS
        assert record["torch_all_gathers"] == {"fresh": 1 + 2 * LAYERS, "used": 1 + LAYERS}
        for name, grad in fresh["grads"].items():
            assert torch.equal(grad, used["grads"][name]), name
