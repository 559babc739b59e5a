"""Hugging Face models sharded at load time (``from_pretrained(distributed_config=
DistributedConfig(fsdp_size=2))``, transformers' native FSDP2 loader) and trained by the
``Trainer``, after ``use_dtensor_fsdp()``: ``evaluate()`` then ``train()`` with gradient
accumulation.

The loader shards with the ``fully_shard`` that ``transformers/distributed/fsdp.py``
bound at import (the switch replaces it). A forward without gradients leaves the root's
parameters unsharded (the root keeps them after forward); before building the optimizer
the Trainer reshards every module that is ``isinstance(module,
torch.distributed.fsdp.FSDPModule)`` (transformers/trainer.py, ``_prepare_for_training``),
so the optimizer gets the sharded parameters. The same script runs with torch's
``fully_shard`` and with ours switched in.
"""

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")

STEPS, MICRO_BATCHES = 3, 2


def _save_tiny_llama(path: str) -> None:
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
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def _evaluate_then_train(path: str) -> dict[str, Any]:
    from transformers.distributed import DistributedConfig

    import dtensor_fsdp

    model = transformers.LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=2)
    )
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            max_steps=STEPS,
            gradient_accumulation_steps=MICRO_BATCHES,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_data(24), eval_dataset=_data(4)
        )
        eval_loss = trainer.evaluate()["eval_loss"]
        recorder = C10dRecorder()
        with recorder:
            trainer.train()
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    return {
        "ours": isinstance(model, dtensor_fsdp.FSDPModule),
        "eval_loss": eval_loss,
        "optimizer_params_sharded": all(isinstance(p, DTensor) for p in optimized),
        "fsdp_modules": sum(isinstance(m, torch_fsdp.FSDPModule) for m in model.modules()),
        "reductions": count_of(recorder.records, "reduce_scatter")
        + count_of(recorder.records, "all_to_all"),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
    }


def _run(rank: int, world_size: int, path: str) -> dict[str, Any]:
    # What torchrun sets; the harness has already joined the gloo group.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="2"
    )
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    if rank == 0:
        _save_tiny_llama(path)
    dist.barrier()
    results = {"torch": _evaluate_then_train(path)}
    with use_dtensor_fsdp():
        results["ours"] = _evaluate_then_train(path)
    return results


def test_evaluate_then_train_gives_the_optimizer_sharded_params(tmp_path):
    for rank in run_distributed(_run, 2, str(tmp_path), timeout=300):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and ours["ours"]
        assert torch_run["optimizer_params_sharded"] and ours["optimizer_params_sharded"]
        # The loader's plan: embedding, each block, norm, head and the root.
        assert ours["fsdp_modules"] == torch_run["fsdp_modules"] == 6
        # Four groups with parameters (the embedding, each block, and norm with head in
        # one call; the root has none left), each reducing once per optimizer step: the
        # Trainer defers every micro-batch's but the last with set_requires_gradient_sync.
        assert ours["reductions"] == torch_run["reductions"] == 4 * STEPS
        assert ours["eval_loss"] == torch_run["eval_loss"]
        assert len(ours["losses"]) == STEPS
        assert ours["losses"] == torch_run["losses"]
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, torch_run["params"][name], rtol=0, atol=0, msg=name)
