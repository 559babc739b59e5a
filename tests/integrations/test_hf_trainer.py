"""Hugging Face's ``Trainer`` on a model sharded with FSDP2, after ``use_dtensor_fsdp()``:
``evaluate()`` then ``train()``.

A forward without gradients leaves the root's parameters unsharded (the root keeps them
after forward). Before building the optimizer the Trainer reshards every module that is
``isinstance(module, torch.distributed.fsdp.FSDPModule)`` (transformers/trainer.py,
``_prepare_for_training``), so the optimizer gets the sharded parameters. The same
script runs with torch's ``fully_shard`` and with ours switched in: it shards through
``torch.distributed.fsdp.fully_shard``, and marks the model as sharded at load time
(``_is_distributed_loading_by_transformers``, what ``from_pretrained(distributed_config=
...)`` sets), the Trainer's path for a model that owns its FSDP2 sharding.
"""

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

from tests._harness import run_distributed

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")

STEPS = 3


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        torch_fsdp.fully_shard(layer)
    torch_fsdp.fully_shard(model)
    model._is_distributed_loading_by_transformers = True
    return model


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def _evaluate_then_train() -> dict[str, Any]:
    import dtensor_fsdp

    model = _tiny_llama()
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            max_steps=STEPS,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_data(16), eval_dataset=_data(4)
        )
        eval_loss = trainer.evaluate()["eval_loss"]
        trainer.train()
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    return {
        "ours": isinstance(model, dtensor_fsdp.FSDPModule),
        "eval_loss": eval_loss,
        "optimizer_params_sharded": all(isinstance(p, DTensor) for p in optimized),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    # What torchrun sets; the harness has already joined the gloo group.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="2"
    )
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    results = {"torch": _evaluate_then_train()}
    with use_dtensor_fsdp():
        results["ours"] = _evaluate_then_train()
    return results


def test_evaluate_then_train_gives_the_optimizer_sharded_params():
    for rank in run_distributed(_run, 2, timeout=300):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and ours["ours"]
        assert torch_run["optimizer_params_sharded"] and ours["optimizer_params_sharded"]
        assert ours["eval_loss"] == torch_run["eval_loss"]
        assert len(ours["losses"]) == STEPS
        assert ours["losses"] == torch_run["losses"]
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, torch_run["params"][name], rtol=0, atol=0, msg=name)
