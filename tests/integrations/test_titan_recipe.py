"""torchtitan's Llama 3 recipe, written out here, with torch's ``fully_shard`` and ours.

What torchtitan's ``parallelize_llama``/``apply_fsdp`` and its trainer do, in order:

1. Meshes: a 1-D world mesh, ``DeviceMesh._unflatten``-ed into named axes; the FSDP
   mesh is the ``dp_shard`` view, the TP mesh the ``tp`` view (each from its own
   ``_unflatten`` call, as torchtitan's ``ParallelDims`` builds them).
2. The model is built on the meta device.
3. TP (4 ranks only), on the ``tp`` view: torchtitan's plan, as
   ``dtensor_fsdp.models.llama.apply_tensor_parallel`` writes it out (column-wise
   wq/wk/wv/w1/w3 and output, row-wise wo/w2 and embedding, sequence-parallel norms),
   so every parameter ends up on the 2-D (dp_shard, tp) mesh and
   ``clip_grad_norm_`` can stack their norms.
4. ``fully_shard`` per transformer block with ``reshard_after_forward=True`` except the
   last block (``False``: FSDP would gather it again at once for backward), then
   ``fully_shard([model.norm, model.output])`` (a list of modules: one group), then the
   root (``tok_embeddings``); all with ``MixedPrecisionPolicy(param_dtype=bf16,
   reduce_dtype=fp32)``.
5. Explicit prefetching: each block forward-prefetches the next (the last block the
   norm/output group); the output backward-prefetches the last block and each block the
   one before it.
6. ``model.to_empty(device="cpu")``, then ``init_weights()`` on the sharded DTensors.
7. ``K`` AdamW steps with ``clip_grad_norm_``; a DCP checkpoint through
   ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` + ``dcp.save``);
   one more step. A second model built by the same recipe from another seed loads it
   (``get_state_dict`` + ``dcp.load`` + ``set_state_dict``) and takes the same step: its
   loss and shards must equal the uninterrupted run's bit for bit. Every step trains on
   the same batch: random tokens have nothing to learn across batches, and a falling
   loss shows that training happens at all.

Comparisons: torch's recipe run twice is bitwise deterministic (the premise); ours and
torch's give bitwise-equal losses and local shards at every step (the same bf16 casts,
fp32 reductions over two ranks and fp32 optimizer: [Note: parity tolerances] in
``_parity.py``, item 1); ours loads torch's checkpoint and continues exactly as torch
does (eager init there, so that it checks the checkpoint and not meta init). The same
recipe with eager init tells a meta-init failure from the rest. One spawn per world
size runs every scenario.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fsdp
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel, cross_entropy_loss
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_equal, make_optimizer
from tests._pool import GlooPools

pytestmark = pytest.mark.skipif(
    not hasattr(DeviceMesh, "_unflatten"), reason="torchtitan's meshes need DeviceMesh._unflatten"
)

K = 3  # steps before the checkpoint; one more after it
BATCH = 2  # sequences per data-parallel rank
INIT_SEED, OTHER_SEED = 1, 2
MAX_NORM = 1.0  # torchtitan's default max_norm
# 3 blocks, so the explicit prefetch chain has a middle; 97 vocabulary rows and 88
# feed-forward rows are uneven over 2 ranks.
CONFIG = LlamaConfig(
    vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)


@dataclass(frozen=True)
class Impl:
    name: str
    fully_shard: Callable[..., Any]
    mp_policy: Any  # the MixedPrecisionPolicy class of the same implementation


IMPLS = {
    "torch": Impl("torch", torch_fully_shard, TorchMixedPrecisionPolicy),
    "ours": Impl("ours", dtensor_fsdp.fully_shard, dtensor_fsdp.MixedPrecisionPolicy),
}


@dataclass(frozen=True)
class Meshes:
    dp: DeviceMesh  # the FSDP ("dp_shard") view
    tp: DeviceMesh | None  # the "tp" view, when TP is on
    dp_rank: int


def _meshes(tp: int) -> Meshes:
    """torchtitan's ParallelDims: one world mesh, unflattened per use into named axes."""
    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    dp_shard = dist.get_world_size() // tp
    dense = world._unflatten(0, (1, dp_shard, tp), ("dp_replicate", "dp_shard", "tp"))
    if tp == 1:
        return Meshes(dense["dp_shard"], None, dense["dp_shard"].get_local_rank())
    # The TP mesh from an _unflatten of its own, as torchtitan makes one per use.
    batch = world._unflatten(0, (dp_shard, tp), ("batch", "tp"))
    return Meshes(dense["dp_shard"], batch["tp"], batch["batch"].get_local_rank())


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------


def _apply_fsdp(model: Llama, mesh: DeviceMesh, impl: Impl) -> None:
    config = {
        "mesh": mesh,
        "mp_policy": impl.mp_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        # As torchtitan: FSDP would prefetch the last block again at once for backward.
        impl.fully_shard(block, **config, reshard_after_forward=i < len(blocks) - 1)
    impl.fully_shard([model.norm, model.output], **config, reshard_after_forward=False)
    impl.fully_shard(model, **config)
    # torchtitan's explicit prefetching.
    for block, next_block in zip(blocks, [*blocks[1:], None], strict=True):
        block.set_modules_to_forward_prefetch(
            [next_block] if next_block is not None else [model.norm, model.output]
        )
    model.output.set_modules_to_backward_prefetch([blocks[-1]])
    reversed_blocks = blocks[::-1]
    for block, previous in zip(reversed_blocks[:-1], reversed_blocks[1:], strict=True):
        block.set_modules_to_backward_prefetch([previous])


def _build(impl: Impl, meshes: Meshes, seed: int, meta: bool = True) -> Llama:
    if meta:
        with torch.device("meta"):
            model = Llama(CONFIG)
    else:
        torch.manual_seed(seed)
        model = Llama(CONFIG)
    if meshes.tp is not None:
        apply_tensor_parallel(model, meshes.tp)
    _apply_fsdp(model, meshes.dp, impl)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
    model.train()
    return model


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, meshes: Meshes) -> float:
    gen = torch.Generator().manual_seed(500)  # the same batch every step: see the docstring
    dp = meshes.dp.size()
    tokens = torch.randint(0, CONFIG.vocab_size, (dp * BATCH, 13), generator=gen)
    tokens = tokens.chunk(dp)[meshes.dp_rank]  # (BATCH, T + 1)
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optim.step()
    optim.zero_grad()
    return loss.item()


def _save(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {
        n: (
            type(p).__name__,
            tuple(p.placements) if isinstance(p, DTensor) else None,
            tuple(p.to_local().shape),
            p.dtype,
        )
        for n, p in model.named_parameters()
    }


def _resume(impl: Impl, meshes: Meshes, meta: bool, path: str) -> dict:
    """A model and optimizer built by the recipe from another seed (so a load that
    changed nothing would show) load ``path`` and take step K."""
    model = _build(impl, meshes, OTHER_SEED, meta)
    optim = make_optimizer(model.parameters())
    _load(model, optim, path)
    return {"loss": _train_step(model, optim, meshes), "shards": _local_shards(model)}


def _recipe(
    impl: Impl,
    meshes: Meshes,
    directory: str,
    *,
    meta: bool = True,
    also_resume_from: str | None = None,
) -> dict:
    """The recipe end to end: K steps, save to ``directory/impl.name``, step K; then
    resume from that checkpoint (and from ``also_resume_from``, another run's)."""
    model = _build(impl, meshes, INIT_SEED, meta)
    layout = _layout(model)
    optim = make_optimizer(model.parameters())
    losses = [_train_step(model, optim, meshes) for _ in range(K)]
    path = os.path.join(directory, impl.name)
    _save(model, optim, path)
    losses.append(_train_step(model, optim, meshes))
    rec = {
        "layout": layout,
        "losses": losses,
        "shards": _local_shards(model),
        "resumed": _resume(impl, meshes, meta, path),
    }
    if also_resume_from is not None:
        rec["resumed_other"] = _resume(impl, meshes, meta, also_resume_from)
    return rec


# ---------------------------------------------------------------------------
# Scenarios (each recipe run is shared by the tests that read it)
# ---------------------------------------------------------------------------


def _torch_twice(meshes: Meshes, directory: str) -> dict:
    return {
        "first": _recipe(IMPLS["torch"], meshes, os.path.join(directory, "first")),
        "second": _recipe(IMPLS["torch"], meshes, os.path.join(directory, "second")),
    }


def _eager(meshes: Meshes, directory: str) -> dict:
    """Eager init, torch's then ours; ours also resumes from torch's checkpoint."""
    torch_run = _recipe(IMPLS["torch"], meshes, directory, meta=False)
    ours_run = _recipe(
        IMPLS["ours"],
        meshes,
        directory,
        meta=False,
        also_resume_from=os.path.join(directory, "torch"),
    )
    return {"torch": torch_run, "ours": ours_run}


def _worker(rank: int, world_size: int, tp: int, directory: str) -> dict:
    """``directory``: the parent's temporary directory, shared by the ranks (one machine)."""
    meshes = _meshes(tp)
    scenarios = {
        "torch_twice": lambda: _torch_twice(meshes, os.path.join(directory, "twice")),
        "ours": lambda: _recipe(IMPLS["ours"], meshes, os.path.join(directory, "ours")),
    }
    if tp == 1:
        scenarios["eager"] = lambda: _eager(meshes, os.path.join(directory, "eager"))
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side: one run per (world size, tp), on the session's pool
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w2_run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("titan_w2"))
    return run_distributed(_worker, 2, 1, tmp, timeout=300, pool=gloo_pool)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("titan_tp"))
    return run_distributed(_worker, 4, 2, tmp, timeout=300, pool=gloo_pool)


@pytest.fixture(params=["fsdp-w2", "fsdp-tp-w4"])
def setup(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    """(name, run): plain FSDP on 2 ranks, or FSDP x TP on a 2 x 2 mesh on 4."""
    fixture = {"fsdp-w2": "w2_run", "fsdp-tp-w4": "tp_run"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def _shard_pairs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    assert sorted(a) == sorted(b)
    return {n: (a[n], b[n]) for n in a}


def _assert_same_run(ours: dict, theirs: dict, where: str) -> None:
    assert ours["layout"] == theirs["layout"], f"{where} layout"
    assert ours["losses"] == theirs["losses"], (
        f"{where} losses {ours['losses']} vs {theirs['losses']}"
    )
    assert_pairs_equal(_shard_pairs(ours["shards"], theirs["shards"]), f"{where} local shard")


def _assert_resumes_exactly(rec: dict, resumed: dict, where: str) -> None:
    """``resumed`` (a model that loaded ``rec``'s checkpoint) took ``rec``'s step K."""
    assert resumed["loss"] == rec["losses"][K], (
        f"{where}: loss after the DCP round trip {resumed['loss']!r} vs "
        f"uninterrupted {rec['losses'][K]!r}"
    )
    assert_pairs_equal(_shard_pairs(resumed["shards"], rec["shards"]), f"{where} resumed shard")


def test_torch_recipe_is_deterministic(setup):
    # The premise of the bitwise comparisons below.
    name, run = setup
    for rank, rec in enumerate(scenario_records(run, "torch_twice")):
        _assert_same_run(rec["first"], rec["second"], f"{name} rank {rank} torch vs torch")
        _assert_resumes_exactly(rec["first"], rec["first"]["resumed"], f"{name} rank {rank} torch")
        losses = rec["first"]["losses"]
        assert losses[-1] < losses[0], f"{name}: did not train: {losses}"


def test_recipe_matches_torch_fully_shard(setup):
    name, run = setup
    theirs = scenario_records(run, "torch_twice")
    for rank, ours in enumerate(scenario_records(run, "ours")):
        _assert_same_run(ours, theirs[rank]["first"], f"{name} rank {rank} ours vs torch")
        # Sharded fp32 DTensors: bf16 is the compute dtype only.
        assert all(
            kind == "DTensor" and dtype == torch.float32
            for kind, _, _, dtype in ours["layout"].values()
        )


def test_recipe_resumes_from_dcp_exactly(setup):
    name, run = setup
    for rank, ours in enumerate(scenario_records(run, "ours")):
        _assert_resumes_exactly(ours, ours["resumed"], f"{name} rank {rank} ours")


def test_recipe_with_eager_init_matches_torch_fully_shard(w2_run):
    # The same recipe without the meta device: tells a meta-init failure from the rest.
    for rank, rec in enumerate(scenario_records(w2_run, "eager")):
        _assert_same_run(rec["ours"], rec["torch"], f"rank {rank} ours vs torch")
        _assert_resumes_exactly(rec["ours"], rec["ours"]["resumed"], f"rank {rank} ours")


def test_ours_resumes_from_a_torch_checkpoint(w2_run):
    # Ours, from torch's checkpoint, takes torch's uninterrupted step K bit for bit.
    for rank, rec in enumerate(scenario_records(w2_run, "eager")):
        _assert_resumes_exactly(rec["torch"], rec["ours"]["resumed_other"], f"rank {rank} ours")
