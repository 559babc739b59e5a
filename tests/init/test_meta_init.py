"""Meta-device init on 2 gloo ranks: build on ``meta``, ``fully_shard`` each block and the
root, ``to_empty(device="cpu")``, then initialize inside ``init_unsharded``. The values
must equal an eager model's init from the same seed bit for bit (our Llama's
``init_weights()``, Hugging Face ``_init_weights`` on a tiny Llama and GPT-2), the RoPE
buffers too, tied embeddings must stay tied, and the model must then train like the
eager one. torch's ``fully_shard`` has no ``init_unsharded``: loading the eager model's
full state dict into it gives the same local shards as ours, and initializing its
sharded DTensors directly gives other values. An exception inside the context leaves
the sharded params registered. One spawn runs every scenario; the memory bound and the
re-gathering of evicted parameters are in test_meta_init_bounded.py.
"""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard, init_unsharded
from dtensor_fsdp.init.lazy_full_tensor import LazyFullTensor
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import (
    assert_pairs_close,
    assert_pairs_equal,
    assert_params_close,
    full_pairs,
    local_pairs,
    make_optimizer,
    mean_over_world,
    placements,
)
from tests._pool import GlooPools
from tests._tiny_llama import uneven_config

WORLD_SIZE = 2
STEPS = 2
BATCH = 2  # sequences per rank
INIT_SEED = 1


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
    config = uneven_config(tie)
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
            n
            for n, p in model.named_parameters()
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
        rec = {
            "loss": (mean_over_world(loss), ref_loss.item()),
            "grads": full_pairs(model, ref, grads=True),
        }
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
        model = Llama(uneven_config(tie=False))
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
    config = uneven_config(tie=False)
    eager = _eager(config)
    with torch.device("meta"):
        model = Llama(config)
    _shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    model.init_weights()
    return not torch.equal(
        model.layers[0].attention.wq.weight.full_tensor(), eager.layers[0].attention.wq.weight
    )


def _not_equal(model: nn.Module, eager: nn.Module) -> list[str]:
    eager_params = dict(eager.named_parameters())
    return [
        n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), eager_params[n])
    ]


def _stats(cache: Any) -> dict[str, int]:
    return {
        k: getattr(cache, k) for k in ("budget_bytes", "peak_bytes", "all_gathers", "live_bytes")
    }


def _meta_llama(mesh: Any, shard: Callable[..., Any] = fully_shard) -> Llama:
    with torch.device("meta"):
        model = Llama(uneven_config(tie=False))
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _torch_reference(mesh: Any) -> dict[str, Any]:
    """torch's fully_shard reaches the eager values only by loading a full state dict
    (the whole model on every rank); initializing its shards directly differs."""
    eager = _eager(uneven_config(tie=False))
    ours = _meta_llama(mesh)
    torch.manual_seed(INIT_SEED)
    with init_unsharded(ours):
        ours.init_weights()
    theirs = _meta_llama(mesh, torch_fully_shard)
    set_model_state_dict(theirs, eager.state_dict(), options=StateDictOptions(full_state_dict=True))
    direct = _meta_llama(mesh, torch_fully_shard)
    torch.manual_seed(INIT_SEED)
    direct.init_weights()
    return {
        "local": local_pairs(ours, theirs, grads=False),
        "placements": (placements(ours), placements(theirs)),
        "torch_direct_not_equal": _not_equal(direct, eager),
    }


def _hf_build(arch: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM
    from transformers import LlamaConfig as HFLlamaConfig

    if arch == "gpt2":  # tied lm_head, Conv1D, the scaled c_proj re-init
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4)
        )
    config = HFLlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=3,
        tie_word_embeddings=False,  # padding_idx: a zeroed row
    )
    return LlamaForCausalLM(config)


def _hf_init(mesh: Any, arch: str) -> dict[str, Any]:
    """HF's own init, ``model.apply(model._init_weights)``, as users call it after a
    meta-device build (``init_weights()`` would skip modules already flagged)."""
    torch.manual_seed(0)
    eager = _hf_build(arch)
    torch.manual_seed(INIT_SEED)
    eager.apply(eager._init_weights)
    with torch.device("meta"):
        model = _hf_build(arch)
    blocks = model.transformer.h if arch == "gpt2" else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    with init_unsharded(model) as cache:
        model.apply(model._init_weights)
    embed = model.get_input_embeddings().weight
    return {
        "not_equal": _not_equal(model, eager),
        "names": [n for n, _ in model.named_parameters()]
        == [n for n, _ in eager.named_parameters()],
        "tied": model.get_output_embeddings().weight is embed,
        "pad_row_zero": arch == "gpt2" or not embed.full_tensor()[3].any().item(),
        "stats": _stats(cache),
    }


class _Boom(Exception):
    pass


def _exception(mesh: Any) -> dict[str, Any]:
    model = _meta_llama(mesh)
    theirs = _meta_llama(mesh, torch_fully_shard)
    before = dict(model.named_parameters())
    try:
        with init_unsharded(model, max_unsharded_bytes=0) as cache, torch.no_grad():
            leaked = model.layers[0].attention.wq.weight
            nn.init.ones_(leaked)
            nn.init.zeros_(model.layers[1].attention.wq.weight)  # evicts the first one
            nn.init.ones_(model.layers[1].attention.wk.weight)  # live at the exception
            raise _Boom
    except _Boom:
        pass
    after = dict(model.named_parameters())
    rec: dict[str, Any] = {
        "same_objects": list(after) == list(before) and all(after[n] is before[n] for n in before),
        "lazy_left": [n for n, p in after.items() if isinstance(p, LazyFullTensor)],
        "placements": (placements(model), placements(theirs)),
        "written": [
            bool((model.layers[0].attention.wq.weight.full_tensor() == 1).all()),
            bool((model.layers[1].attention.wq.weight.full_tensor() == 0).all()),
            bool((model.layers[1].attention.wk.weight.full_tensor() == 1).all()),
        ],
        "closed": (cache.closed, cache.live_bytes),
    }
    try:
        with torch.no_grad():
            leaked.zero_()
    except RuntimeError as error:
        rec["use_after_exit"] = str(error)
    return rec


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "untied": lambda: _meta_init(rank, mesh, tie=False),
            "tied": lambda: _meta_init(rank, mesh, tie=True),
            "before_to_empty": lambda: _init_before_to_empty(mesh),
            "sharded_init_differs": lambda: _sharded_init_differs(mesh),
            "torch_reference": lambda: _torch_reference(mesh),
            "hf_llama": lambda: _hf_init(mesh, "llama"),
            "hf_gpt2": lambda: _hf_init(mesh, "gpt2"),
            "exception": lambda: _exception(mesh),
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, pool=gloo_pool)


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
            assert_params_close(
                step_rec["params"], f"rank {rank} step {step} param", steps=step + 1
            )


def test_init_unsharded_before_to_empty_raises(run):
    for message in scenario_records(run, "before_to_empty"):
        assert message is not None and "meta" in message and "to_empty" in message


def test_initializing_shards_directly_draws_other_numbers(run):
    assert all(scenario_records(run, "sharded_init_differs"))


def test_matches_torch_fully_shard_loaded_from_the_eager_state_dict(run):
    for rec in scenario_records(run, "torch_reference"):
        assert_pairs_equal(rec["local"], "local shard")
        ours, theirs = rec["placements"]
        assert ours == theirs
        # torch's fully_shard initialized shard by shard draws other numbers.
        assert len(rec["torch_direct_not_equal"]) > 10


@pytest.mark.parametrize("arch", ["hf_llama", "hf_gpt2"])
def test_hugging_face_init_weights_bit_for_bit(run, arch):
    pytest.importorskip("transformers")
    for rec in scenario_records(run, arch):
        assert rec["not_equal"] == [] and rec["names"]
        assert rec["tied"] == (arch == "hf_gpt2")
        assert rec["pad_row_zero"]
        assert rec["stats"]["peak_bytes"] <= rec["stats"]["budget_bytes"]


def test_exception_inside_restores_the_sharded_params(run):
    for rec in scenario_records(run, "exception"):
        assert rec["same_objects"] and rec["lazy_left"] == []
        ours, theirs = rec["placements"]
        assert ours == theirs
        # Written back: the evicted one, and the one live when the exception came.
        assert rec["written"] == [True, True, True]
        assert rec["closed"] == (True, 0)
        assert "after the init_unsharded context exited" in rec["use_after_exit"]
        assert "layers.0.attention.wq.weight" in rec["use_after_exit"]
