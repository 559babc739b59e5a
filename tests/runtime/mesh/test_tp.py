"""FSDP + tensor parallelism on 4 gloo ranks: a 2 x 2 ``(dp, tp)`` mesh, TP and FSDP on
two ``_unflatten`` views of one world mesh (as torchtitan builds them), and HSDP + TP
on a 2 x 1 x 2 ``(replicate, shard, tp)`` mesh.

The Llama-style model is parallelized with ``apply_tensor_parallel`` on ``mesh["tp"]``
(column-wise wq/wk/wv/w1/w3 and output head, row-wise wo/w2 and embedding, sequence
parallel norms), then each block and the root go through ``fully_shard`` with the data
parallel sub-mesh. Parameters become DTensors on the two meshes concatenated (``(dp,
tp)``, as torch builds it) with FSDP's placement in front of the TP one; where both
shard dim 0 (column-wise weights), FSDP's is a ``_StridedShard``, as in torch. Both
TP ranks of one data-parallel rank see the same batch slice.

References: a single-process model on the global batch (losses, clipped grad norms,
``full_tensor()`` grads and params), and torch's ``fully_shard`` on the same meshes
(placements, local shards and local grads). One spawn runs every scenario.
"""

import copy
from collections.abc import Callable

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel, cross_entropy_loss
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import (
    assert_pairs_close,
    assert_pairs_equal,
    assert_params_close,
    assert_train_parity,
    full,
    make_optimizer,
    placements,
    step_against_torch,
    train_against_reference,
)
from tests._pool import GlooPools

WORLD_SIZE, DP, TP = 4, 2, 2
STEPS = 3
PER_DP_RANK_BATCH = 2
CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)


def _build() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (DP * PER_DP_RANK_BATCH, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]  # each (B, T=16)


def _parallelize(
    model: Llama, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, shard: Callable = fully_shard
) -> Llama:
    apply_tensor_parallel(model, tp_mesh)
    for block in model.layers:
        shard(block, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    return model


def _local(dp_rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.chunk(DP)[dp_rank]


# ---------------------------------------------------------------------------
# Scenarios (run in every rank)
# ---------------------------------------------------------------------------


def _init(mesh: DeviceMesh) -> dict:
    base = _build()
    ours = _parallelize(copy.deepcopy(base), mesh["tp"], mesh["dp"])
    theirs = _parallelize(copy.deepcopy(base), mesh["tp"], mesh["dp"], shard=torch_fully_shard)
    originals = dict(base.named_parameters())
    return {
        "placements": (placements(ours), placements(theirs)),
        "meshes": {name: p.device_mesh.mesh_dim_names for name, p in ours.named_parameters()},
        "full": {
            name: (full(p), originals[name].detach().clone()) for name, p in ours.named_parameters()
        },
    }


def _train(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, dp_rank: int) -> list[dict]:
    base = _build()
    model = _parallelize(copy.deepcopy(base), tp_mesh, dp_mesh)
    batches = [_batch(step) for step in range(STEPS)]
    return train_against_reference(model, base, batches, _local(dp_rank), cross_entropy_loss)


def _torch_parity(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, dp_rank: int) -> list[dict]:
    base = _build()
    ours = _parallelize(copy.deepcopy(base), tp_mesh, dp_mesh)
    theirs = _parallelize(copy.deepcopy(base), tp_mesh, dp_mesh, shard=torch_fully_shard)
    opts = make_optimizer(ours.parameters()), make_optimizer(theirs.parameters())
    local = _local(dp_rank)
    records = []
    for step in range(2):
        x, y = _batch(step)
        losses = [cross_entropy_loss(m(local(x)), local(y)) for m in (ours, theirs)]
        records.append(step_against_torch(ours, theirs, opts, losses))
    return records


def _unflattened_views() -> dict:
    """torchtitan's meshes: TP on one ``_unflatten`` view of a 1-D world mesh, FSDP on
    another view of it (torch concatenates them; they share no root but the world)."""
    world = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("world",))
    data = world._unflatten(0, (DP, TP), ("batch", "tp"))
    dense = world._unflatten(0, (DP, TP), ("fsdp", "tp"))
    base = _build()
    layouts = []
    for shard in (fully_shard, torch_fully_shard):
        model = _parallelize(copy.deepcopy(base), data["tp"], dense["fsdp"], shard=shard)
        meshes = {name: p.device_mesh for name, p in model.named_parameters()}
        layouts.append((placements(model), meshes))
    return {
        "layouts": layouts,
        "steps": _torch_parity(data["tp"], dense["fsdp"], dense.get_local_rank("fsdp")),
    }


def _hsdp_tp(mesh: DeviceMesh) -> dict:
    base = _build()
    model = _parallelize(copy.deepcopy(base), mesh["tp"], mesh["replicate", "shard"])
    theirs = _parallelize(
        copy.deepcopy(base), mesh["tp"], mesh["replicate", "shard"], shard=torch_fully_shard
    )
    layout = placements(model), placements(theirs)
    dp_rank = mesh.get_local_rank("replicate")  # the shard axis has one rank
    batches = [_batch(step) for step in range(STEPS)]
    records = train_against_reference(model, base, batches, _local(dp_rank), cross_entropy_loss)
    return {"placements": layout, "steps": records}


def _second_root_mesh() -> list[dict]:
    """FSDP + TP on a (dp, tp) mesh built after the (replicate, shard, tp) one, whose
    "tp" sub-mesh has the same ranks: equal as DeviceMeshes, different roots.

    DTensor's sharding-propagation cache keys on mesh equality, so ``nn.Parameter(d)``
    of a DTensor on the second mesh's "tp" comes back on the first mesh's (equal) "tp"
    object, whose root is the other mesh. fully_shard must still accept it.
    """
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    return _train(mesh["tp"], mesh["dp"], mesh.get_local_rank("dp"))[:1]


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    return run_scenarios(
        {
            "init": lambda: _init(mesh),
            "train": lambda: _train(mesh["tp"], mesh["dp"], mesh.get_local_rank("dp")),
            "torch_parity": lambda: _torch_parity(
                mesh["tp"], mesh["dp"], mesh.get_local_rank("dp")
            ),
            "unflattened_views": _unflattened_views,
        }
    )


def _hsdp_worker(rank: int, world_size: int) -> dict:
    # A spawn of its own: see _second_root_mesh for what sharing one with the (dp, tp)
    # mesh above runs into.
    mesh = init_device_mesh("cpu", (2, 1, TP), mesh_dim_names=("replicate", "shard", "tp"))
    return run_scenarios(
        {
            "hsdp_tp": lambda: _hsdp_tp(mesh),
            "second_root_mesh": _second_root_mesh,
        }
    )


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=180, pool=gloo_pool)


@pytest.fixture(scope="module")
def hsdp_run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_hsdp_worker, WORLD_SIZE, timeout=180, pool=gloo_pool)


COLWISE = (_StridedShard(0, split_factor=TP), Shard(0))  # FSDP chunks TP's row chunk
ROWWISE = (Shard(0), Shard(1))
SEQUENCE_PARALLEL = (Shard(0), Replicate())  # norms: replicated over TP


def _expected_placements(name: str) -> tuple:
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
        return COLWISE
    if name == "output.weight" or name == "tok_embeddings.weight":
        return COLWISE  # column-wise head; the row-wise embedding also shards dim 0
    if name.endswith(("wo.weight", "w2.weight")):
        return ROWWISE
    assert name.endswith("norm.weight"), name
    return SEQUENCE_PARALLEL


def test_placements_on_the_root_mesh_match_torch(run):
    for rank, rec in enumerate(scenario_records(run, "init")):
        ours, theirs = rec["placements"]
        assert ours == theirs, f"rank {rank}"
        for name, (placement, _) in ours.items():
            assert placement == _expected_placements(name), f"rank {rank} {name}: {placement}"
            assert rec["meshes"][name] == ("dp", "tp"), f"rank {rank} {name}"
        assert_pairs_close(rec["full"], f"rank {rank} full_tensor() vs original", atol=0, rtol=0)


def test_training_matches_single_process(run):
    assert_train_parity(scenario_records(run, "train"), STEPS)


def _assert_torch_parity(ranks: list[list[dict]]) -> None:
    for rank, records in enumerate(ranks):
        for step, rec in enumerate(records):
            where = f"rank {rank} step {step}"
            ours, theirs = rec["loss"]
            # Bitwise: [Note: parity tolerances] in _parity.py, item 1.
            assert ours == theirs, where
            assert_pairs_equal(rec["grads"], f"{where} local grad vs torch")
            assert_pairs_equal(rec["params"], f"{where} local shard vs torch")


def test_matches_torch_fully_shard_on_the_same_meshes(run):
    _assert_torch_parity(scenario_records(run, "torch_parity"))


def test_tp_and_dp_meshes_from_unflattened_views_of_one_world(run):
    records = scenario_records(run, "unflattened_views")
    for rank, rec in enumerate(records):
        (ours, our_meshes), (theirs, their_meshes) = rec["layouts"]
        assert ours == theirs, f"rank {rank}"
        assert our_meshes == their_meshes, f"rank {rank}"
        for name, (placement, _) in ours.items():
            assert placement == _expected_placements(name), f"rank {rank} {name}: {placement}"
            assert our_meshes[name].mesh_dim_names == ("fsdp", "tp"), f"rank {rank} {name}"
    _assert_torch_parity([rec["steps"] for rec in records])


def test_hsdp_with_tp_matches_single_process(hsdp_run):
    records = scenario_records(hsdp_run, "hsdp_tp")
    for rank, rec in enumerate(records):
        ours, theirs = rec["placements"]
        assert ours == theirs, f"rank {rank}"
        for name, (placement, _) in ours.items():
            # As in torch, strided even though the one-rank shard axis does not interleave.
            assert placement == (Replicate(), *_expected_placements(name)), f"rank {rank} {name}"
    assert_train_parity([rec["steps"] for rec in records], STEPS)


def test_tp_mesh_equal_to_another_roots_sub_mesh(hsdp_run):
    records = scenario_records(hsdp_run, "second_root_mesh")
    for rank, steps in enumerate(records):
        assert_params_close(steps[0]["params"], f"rank {rank} param", steps=1)
