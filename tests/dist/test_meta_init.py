"""Meta-device init on 2 gloo ranks: build the Llama model on ``meta``, ``fully_shard``
each block and the root, ``to_empty(device="cpu")``, then ``init_weights()`` inside
``init_unsharded``. The values must equal an eager model's ``init_weights()`` from the
same seed bit for bit, the RoPE buffers too, tied embeddings must stay tied, and the
model must then train like the eager one. One spawn runs every scenario.
"""

import copy
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard, init_unsharded
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests.dist._parity import (
    assert_pairs_close,
    assert_params_close,
    full_pairs,
    make_optimizer,
    mean_over_world,
)

WORLD_SIZE = 2
STEPS = 2
BATCH = 2  # sequences per rank
INIT_SEED = 1


def _config(tie: bool) -> LlamaConfig:
    # 97 vocabulary rows are uneven over 2 ranks: the last shard is padded.
    return LlamaConfig(
        vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88,
        max_seq_len=16, tie_embeddings=tie,
    )


def _shard(model: Llama, mesh: Any) -> Llama:
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _eager(config: LlamaConfig) -> Llama:
    torch.manual_seed(0)  # the constructor's own init draws, then the init under test
    eager = Llama(config)
    torch.manual_seed(INIT_SEED)
    eager.init_weights()
    return eager


def _meta_init(rank: int, mesh: Any, tie: bool) -> dict[str, Any]:
    config = _config(tie)
    eager = _eager(config)
    with torch.device("meta"):
        model = Llama(config)
    _shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    with init_unsharded(model):
        model.init_weights()
    eager_params = dict(eager.named_parameters())
    out: dict[str, Any] = {
        "not_equal": [
            n for n, p in model.named_parameters()
            if not torch.equal(p.full_tensor(), eager_params[n])
        ],
        "names": ([n for n, _ in model.named_parameters()], list(eager_params)),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_numels": {n: p.to_local().numel() for n, p in model.named_parameters()},
        "buffers_equal": {
            n: torch.equal(b, dict(eager.named_buffers())[n]) for n, b in model.named_buffers()
        },
        "still_tied": model.output.weight is model.tok_embeddings.weight,
        "devices": {p.to_local().device.type for p in model.parameters()},
    }
    # Then train both in lockstep: ours on this rank's rows, eager on the global batch.
    ref = copy.deepcopy(eager)
    optim, ref_optim = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    steps = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        tokens = torch.randint(0, config.vocab_size, (WORLD_SIZE * BATCH, 9), generator=gen)
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        loss = cross_entropy_loss(model(inp.chunk(WORLD_SIZE)[rank]), tgt.chunk(WORLD_SIZE)[rank])
        loss.backward()
        ref_loss = cross_entropy_loss(ref(inp), tgt)
        ref_loss.backward()
        rec = {"loss": (mean_over_world(loss), ref_loss.item()), "grads": full_pairs(model, ref, grads=True)}
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        rec["params"] = full_pairs(model, ref, grads=False)
        steps.append(rec)
    out["steps"] = steps
    out["still_tied_after_training"] = model.output.weight is model.tok_embeddings.weight
    return out


def _init_before_to_empty(mesh: Any) -> str | None:
    with torch.device("meta"):
        model = Llama(_config(tie=False))
    _shard(model, mesh)
    try:
        with init_unsharded(model):
            model.init_weights()
    except RuntimeError as error:
        return str(error)
    return None


def _sharded_init_differs(mesh: Any) -> bool:
    """Initializing the sharded DTensors directly (no init_unsharded) runs, but draws
    other numbers than eager init: the reason init_unsharded exists."""
    config = _config(tie=False)
    eager = _eager(config)
    with torch.device("meta"):
        model = Llama(config)
    _shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    model.init_weights()
    return not torch.equal(model.layers[0].attention.wq.weight.full_tensor(), eager.layers[0].attention.wq.weight)


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "untied": lambda: _meta_init(rank, mesh, tie=False),
        "tied": lambda: _meta_init(rank, mesh, tie=True),
        "before_to_empty": lambda: _init_before_to_empty(mesh),
        "sharded_init_differs": lambda: _sharded_init_differs(mesh),
    })


@pytest.fixture(scope="module")
def run() -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_equals_eager_init_bit_for_bit(run, tie):
    for rank, rec in enumerate(scenario_records(run, "tied" if tie else "untied")):
        ours, eager = rec["names"]
        assert ours == eager and len(ours) == (20 if tie else 21)
        assert rec["not_equal"] == []
        assert rec["all_dtensor"] and rec["devices"] == {"cpu"}
        # The RoPE tables (non-persistent buffers that to_empty left uninitialized).
        assert rec["buffers_equal"] == {"rope_cos": True, "rope_sin": True}
        # Each rank keeps its shard only: 97 vocab rows -> 49 on rank 0, 48 on rank 1.
        assert rec["local_numels"]["tok_embeddings.weight"] == (49, 48)[rank] * 32


def test_tied_embeddings_stay_tied(run):
    for rec in scenario_records(run, "tied"):
        assert rec["still_tied"] and rec["still_tied_after_training"]
    assert not scenario_records(run, "untied")[0]["still_tied"]


@pytest.mark.parametrize("tie", [False, True])
def test_meta_initialized_model_trains_like_eager(run, tie):
    for rank, rec in enumerate(scenario_records(run, "tied" if tie else "untied")):
        for step, step_rec in enumerate(rec["steps"]):
            ours, ref = step_rec["loss"]
            assert ours == pytest.approx(ref, rel=1e-5), f"rank {rank} step {step}"
            assert_pairs_close(step_rec["grads"], f"rank {rank} step {step} grad")
            assert_params_close(step_rec["params"], f"rank {rank} step {step} param", steps=step + 1)


def test_init_unsharded_before_to_empty_raises(run):
    for message in scenario_records(run, "before_to_empty"):
        assert message is not None and "meta" in message and "to_empty" in message


def test_initializing_shards_directly_draws_other_numbers(run):
    assert all(scenario_records(run, "sharded_init_differs"))
