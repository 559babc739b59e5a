"""Hugging Face ``transformers`` and ``peft`` models under ``fully_shard``, side by side
with torch's ``fully_shard`` on 2 gloo ranks.

A tiny ``LlamaForCausalLM`` (built from a ``LlamaConfig``, no download) is sharded the
way users shard it: ``fully_shard`` on every decoder layer, then on the root. Variants:

- ``untied``: separate ``embed_tokens`` and ``lm_head`` weights;
- ``tied``: ``tie_word_embeddings=True``, so one ``Parameter`` serves both; both modules
  belong to the root, so the tied pair lives in one group, as torch requires;
- ``lora``: ``peft`` LoRA adapters on ``q_proj``/``v_proj`` over a frozen base; the
  optimizer gets the trainable (adapter) parameters only.

Ours and torch's start from one deep-copied model and train ``STEPS`` AdamW steps on the
same per-rank batches (HF's own shifted next-token loss). Per step, the losses, each
rank's local gradients and, after the optimizer step, its local shards must be bitwise
equal: both run the same local matmuls on the same shards and the same collectives
([Note: parity tolerances] in ``_parity.py``, item 1). The registered parameters (FQNs,
placements, local shapes, ``requires_grad``) must be the same too.

``transformers`` takes seconds to import, so it is imported in the child only, and one
spawn runs every variant.
"""

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_equal, local_pairs, local_trainable_grad_pairs
from tests._pool import GlooPools

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs transformers and peft (the [test] extra)",
)

WORLD_SIZE = 2
STEPS = 5
BATCH, SEQ_LEN = 2, 16  # per rank
VOCAB = 128
VARIANTS = ("untied", "tied", "lora")


def _build(variant: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ_LEN,
        tie_word_embeddings=variant == "tied",
        # SDPA: FlexAttention's backward is not supported on CPU (torch 2.13).
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        # lora_dropout=0: dropout would draw from each process's RNG in a different
        # order for the two copies trained in one process.
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    # LlamaForCausalLM.model.layers; peft wraps it as PeftModel.base_model.model.
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    return list(inner.model.layers)


def _shard(model: nn.Module, mesh: DeviceMesh, shard: Any) -> nn.Module:
    for layer in _decoder_layers(model):
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _tokens() -> torch.Tensor:
    """The global batch: every rank's rows, identical on all ranks. The same one every
    step: random tokens have nothing to learn across batches, so only a repeated batch
    shows the loss going down (that training happens at all)."""
    gen = torch.Generator().manual_seed(3000)
    return torch.randint(0, VOCAB, (WORLD_SIZE * BATCH, SEQ_LEN), generator=gen)


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {
        name: (
            type(p).__name__,
            isinstance(p, DTensor),
            tuple(p.placements) if isinstance(p, DTensor) else None,
            tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
            p.dtype,
            p.requires_grad,
        )
        for name, p in model.named_parameters()
    }


def _train_side_by_side(rank: int, mesh: DeviceMesh, variant: str) -> dict:
    base = _build(variant)
    ours = _shard(copy.deepcopy(base), mesh, fully_shard)
    theirs = _shard(copy.deepcopy(base), mesh, torch_fully_shard)
    rec: dict[str, Any] = {
        "layout": (_layout(ours), _layout(theirs)),
        "tied": [
            m.get_output_embeddings().weight is m.get_input_embeddings().weight
            for m in (ours, theirs)
        ],
        "frozen_names": sorted(n for n, p in ours.named_parameters() if not p.requires_grad),
    }
    optims = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for m in (ours, theirs)
    ]
    initial = local_pairs(ours, theirs, grads=False)
    steps = []
    for step in range(STEPS):
        tokens = _tokens().chunk(WORLD_SIZE)[rank]  # (BATCH, SEQ_LEN)
        losses = [m(input_ids=tokens, labels=tokens).loss for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        srec = {
            "loss": tuple(loss.item() for loss in losses),
            "grads": local_trainable_grad_pairs(ours, theirs),
        }
        for optim in optims:
            optim.step()
            optim.zero_grad()
        srec["params"] = local_pairs(ours, theirs, grads=False)
        steps.append(srec)
    rec["steps"] = steps
    final = steps[-1]["params"]
    rec["moved"] = sorted(n for n in final if not torch.equal(final[n][0], initial[n][0]))
    return rec


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({v: (lambda v=v: _train_side_by_side(rank, mesh, v)) for v in VARIANTS})


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=240, pool=gloo_pool)


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_llama_trains_like_torch_fully_shard(run, variant):
    for rank, rec in enumerate(scenario_records(run, variant)):
        ours_layout, their_layout = rec["layout"]
        assert ours_layout == their_layout, f"rank {rank}"
        losses = []
        for step, srec in enumerate(rec["steps"]):
            where = f"rank {rank} step {step}"
            ours, theirs = srec["loss"]
            assert ours == theirs, f"{where} loss {ours!r} vs torch {theirs!r}"
            losses.append(ours)
            assert_pairs_equal(srec["grads"], f"{where} local grad vs torch")
            assert_pairs_equal(srec["params"], f"{where} local shard vs torch")
        assert losses[-1] < losses[0], f"rank {rank}: did not train: {losses}"
        assert rec["moved"], f"rank {rank}: no parameter moved"


def test_hf_llama_tied_embeddings_stay_tied(run):
    for rec in scenario_records(run, "tied"):
        assert rec["tied"] == [True, True]
        # One Parameter, registered once (under the embedding's FQN).
        names = list(rec["layout"][0])
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    for rec in scenario_records(run, "untied"):
        assert rec["tied"] == [False, False]


def test_peft_lora_trains_only_the_adapters(run):
    for rank, rec in enumerate(scenario_records(run, "lora")):
        layout = rec["layout"][0]
        trainable = sorted(n for n, v in layout.items() if v[-1])
        assert trainable and all("lora_" in n for n in trainable), f"rank {rank}: {trainable}"
        assert rec["frozen_names"] and not any("lora_" in n for n in rec["frozen_names"])
        # Only adapters get grads (recorded for requires_grad params) and move.
        assert sorted(rec["steps"][0]["grads"]) == trainable
        assert rec["moved"] and all("lora_" in n for n in rec["moved"]), rec["moved"]
