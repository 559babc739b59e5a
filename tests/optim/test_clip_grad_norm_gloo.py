"""``dtensor_fsdp.optim.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``.

Each scenario builds the same model under torch's ``fully_shard`` and ours, runs one
backward, then clips the same grads twice, restoring them in between: with torch's
function (on the DTensor grads) and with ours (on their local tensors). Recorded: the
two norms (equal to 1e-6 relative: the same fp32 terms summed in another order), the
clipped local grads (scaled by coefficients that differ as the norms do), the returned
types, and the collectives each issued, counted at the c10d level (ours: exactly one
all-reduce of one fp32 scalar per mesh). A single-process model on the global batch
gives the reference norm (to 1e-5: its grads differ from the ranks' by reduction-order
rounding, see tests/_parity.py, [Note: parity tolerances], item 2).

Layouts: FSDP (W=2, and W=4 with empty local shards), HSDP on a 2 x 2 (replicate,
shard) mesh, whose all-reduce must leave the replicate axis out, and FSDP + TP on a
2 x 2 (dp, tp) mesh, where norms are TP-replicated and the other weights TP-sharded.
Also: non-finite norms (``error_if_nonfinite``), params without grads, plain tensors
mixed in, ``foreach=False``, and a ``max_norm`` that does not fire.
"""

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel, cross_entropy_loss
from dtensor_fsdp.optim import clip_grad_norm_, get_total_norm
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)
GLOBAL_BATCH = 4
MAX_NORM = 0.05  # below the test models' grad norms: clipping fires
NORM_RTOL = 1e-6  # the target; observed differences are a few fp32 ulps
REFERENCE_RTOL = 1e-5  # against a single process: item 2 of [Note: parity tolerances]
NORM_TYPES = {"2": 2.0, "1": 1.0, "inf": math.inf}
ONE_SCALAR_ALL_REDUCE = [("all_reduce", 4)]  # one fp32 0-dim tensor


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(
        0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.max_seq_len + 1), generator=generator
    )


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _mlp() -> nn.Sequential:
    """6 and 3 rows: at W=4 rank 3 holds empty shards of both weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _shard_all(model: nn.Module, children: list[nn.Module], mesh: DeviceMesh, shard) -> nn.Module:
    for child in children:
        shard(child, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _backward(model: nn.Module, dp_rank: int, dp_size: int) -> None:
    if isinstance(model, Llama):
        tokens = _tokens().chunk(dp_size)[dp_rank]
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    else:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(8, 8, generator=generator).chunk(dp_size)[dp_rank]
        model(x).pow(2).mean().backward()


def _local_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for p in params
        if p.grad is not None
    ]


def _restore(params: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    for grad, value in zip(grads, saved, strict=True):
        (grad.to_local() if isinstance(grad, DTensor) else grad).copy_(value)


def _describe(norm: torch.Tensor) -> tuple:
    if isinstance(norm, DTensor):
        return ("DTensor", tuple(norm.placements), norm.full_tensor().item(), norm.item())
    return ("Tensor", (), norm.item(), norm.item())


def _clip_both(params: list[torch.Tensor], max_norm: float, norm_type: float, **kwargs) -> dict:
    """torch's clip, then (grads restored) ours, on the same grads."""
    saved = _local_grads(params)
    record = {"before": saved}
    for name, clip in (("torch", torch.nn.utils.clip_grad_norm_), ("ours", clip_grad_norm_)):
        _restore(params, saved)
        with C10dRecorder() as recorder:
            norm = clip(params, max_norm, norm_type, **kwargs)
        record[name] = {
            "norm": _describe(norm),
            "grads": _local_grads(params),
            "comms": recorder.records,
        }
    return record


def _reference_norm(model: nn.Module, norm_type: float) -> float:
    _backward(model, 0, 1)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type).item()


def _scenario_clip(
    build: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module, Callable], nn.Module],
    dp_rank: int,
    dp_size: int,
    norm_type: float,
) -> dict:
    records = {"reference": _reference_norm(build(), norm_type)}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = parallelize(build(), shard)
        _backward(model, dp_rank, dp_size)
        records[name] = _clip_both(list(model.parameters()), MAX_NORM, norm_type)
    return records


def _fsdp(mesh: DeviceMesh) -> Callable[[nn.Module, Callable], nn.Module]:
    def parallelize(model: nn.Module, shard: Callable) -> nn.Module:
        children = list(model.layers) if isinstance(model, Llama) else list(model)
        return _shard_all(model, children, mesh, shard)

    return parallelize


def _fsdp_tp(mesh: DeviceMesh) -> Callable[[nn.Module, Callable], nn.Module]:
    def parallelize(model: nn.Module, shard: Callable) -> nn.Module:
        apply_tensor_parallel(model, mesh["tp"])
        return _shard_all(model, list(model.layers), mesh["dp"], shard)

    return parallelize


def _sharded_llama(mesh: DeviceMesh) -> Llama:
    model = _fsdp(mesh)(_llama(), fully_shard)
    _backward(model, dist.get_rank(), dist.get_world_size())
    return model


def _scenario_nonfinite(mesh: DeviceMesh) -> dict:
    """A NaN in rank 0's shard only: every rank must see the non-finite norm."""
    records = {}
    for name, clip in (("torch", torch.nn.utils.clip_grad_norm_), ("ours", clip_grad_norm_)):
        model = _sharded_llama(mesh)
        if dist.get_rank() == 0:
            model.layers[0].attention.wq.weight.grad.to_local()[0, 0] = float("nan")
        before = _local_grads(list(model.parameters()))
        try:
            clip(model.parameters(), MAX_NORM, error_if_nonfinite=True)
            error = None
        except RuntimeError as exc:
            error = (type(exc).__name__, str(exc))
        unchanged = all(  # bitwise, NaN included
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(before, _local_grads(list(model.parameters())), strict=True)
        )
        nan_norm = clip(model.parameters(), MAX_NORM)  # error_if_nonfinite=False
        records[name] = {
            "error": error,
            "unchanged": unchanged,
            "norm_is_nan": math.isnan(_describe(nan_norm)[2]),
        }
    return records


def _scenario_some_grads_none(mesh: DeviceMesh) -> dict:
    records = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = _fsdp(mesh)(_llama(), shard)
        _backward(model, dist.get_rank(), dist.get_world_size())
        for p in model.layers[1].parameters():
            p.grad = None
        records[name] = _clip_both(list(model.parameters()), MAX_NORM, 2.0)
    return records


def _scenario_plain_mixed(mesh: DeviceMesh) -> dict:
    """A plain param next to the DTensor ones: its norm counts on each rank, after the
    all-reduce. torch's function cannot mix DTensor and Tensor norms."""
    model = _sharded_llama(mesh)
    plain = nn.Parameter(torch.zeros(5))
    plain.grad = torch.full((5,), 0.5)
    params = [*model.parameters(), plain]
    dtensor_norm = get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
    try:
        torch.nn.utils.clip_grad_norm_(copy.copy(params), 1e9)
        torch_error = None
    except RuntimeError as exc:
        torch_error = type(exc).__name__
    with C10dRecorder() as recorder:
        norm = clip_grad_norm_(params, MAX_NORM)
    return {
        "ours": _describe(norm),
        "expected": math.sqrt(dtensor_norm**2 + 5 * 0.5**2),
        "plain_grad": plain.grad.clone(),
        "comms": recorder.records,
        "torch_error": torch_error,
    }


def _scenario_foreach_false(mesh: DeviceMesh) -> dict:
    params = list(_sharded_llama(mesh).parameters())
    return _clip_both(params, MAX_NORM, 2.0, foreach=False)


def _scenario_not_firing(mesh: DeviceMesh) -> dict:
    params = list(_sharded_llama(mesh).parameters())
    return _clip_both(params, 1e6, 2.0)


def _worker_2(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    scenarios = {
        f"fsdp/{name}": (
            lambda norm_type=norm_type: _scenario_clip(
                _llama, _fsdp(mesh), rank, world_size, norm_type
            )
        )
        for name, norm_type in NORM_TYPES.items()
    }
    scenarios["nonfinite"] = lambda: _scenario_nonfinite(mesh)
    scenarios["some_grads_none"] = lambda: _scenario_some_grads_none(mesh)
    scenarios["plain_mixed"] = lambda: _scenario_plain_mixed(mesh)
    scenarios["foreach_false"] = lambda: _scenario_foreach_false(mesh)
    scenarios["not_firing"] = lambda: _scenario_not_firing(mesh)
    return run_scenarios(scenarios)


def _worker_4(rank: int, world_size: int) -> dict:
    world = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    scenarios = {"uneven": lambda: _scenario_clip(_mlp, _fsdp(world), rank, world_size, 2.0)}
    for name in ("2", "inf"):
        norm_type = NORM_TYPES[name]
        # HSDP: the global batch over all 4 ranks (replicate-major); FSDP + TP: over
        # the 2 data-parallel ranks, shared by the TP pair.
        scenarios[f"hsdp/{name}"] = lambda n=norm_type: _scenario_clip(
            _llama, _fsdp(hsdp), rank, world_size, n
        )
        scenarios[f"fsdp_tp/{name}"] = lambda n=norm_type: _scenario_clip(
            _llama, _fsdp_tp(tp), tp.get_local_rank("dp"), 2, n
        )
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_2(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker_2, 2, pool=gloo_pool)


@pytest.fixture(scope="module")
def run_4(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker_4, 4, timeout=180, pool=gloo_pool)


def _assert_same_clip(record: dict, where: str) -> None:
    """Ours vs torch's on the same grads: norm, returned type, clipped grads, comms."""
    ours, theirs = record["ours"], record["torch"]
    kind, placements, full_value, item = ours["norm"]
    # A DTensor, as torch's; always Replicate (torch's is Partial(max) for the inf-norm),
    # so full_tensor(), item() and to_local() all give the total.
    assert kind == theirs["norm"][0] == "DTensor", where
    assert placements and all(p == Replicate() for p in placements), where
    assert full_value == item, where
    assert full_value == pytest.approx(theirs["norm"][2], rel=NORM_RTOL, abs=0), where
    for a, b in zip(ours["grads"], theirs["grads"], strict=True):
        # Scaled by coefficients that differ by the norms' relative difference.
        torch.testing.assert_close(a, b, rtol=2 * NORM_RTOL, atol=0, msg=where)
    assert ours["comms"] == ONE_SCALAR_ALL_REDUCE, f"{where}: {ours['comms']}"


def _assert_scenario(records: list[dict], name: str) -> None:
    for rank, rec in enumerate(records):
        for impl in ("ours", "torch"):
            where = f"{name} rank {rank}, on {impl}'s fully_shard grads"
            _assert_same_clip(rec[impl], where)
            assert rec[impl]["ours"]["norm"][2] == pytest.approx(
                rec["reference"], rel=REFERENCE_RTOL
            ), where
            clipped, before = rec[impl]["ours"]["grads"], rec[impl]["before"]
            if any(g.numel() for g in before):  # else all this rank's shards are empty
                assert any(not torch.equal(a, b) for a, b in zip(clipped, before)), (
                    f"{where}: clipping should fire"
                )


@pytest.mark.parametrize("norm", sorted(NORM_TYPES))
def test_fsdp(run_2: list[dict], norm: str) -> None:
    _assert_scenario(scenario_records(run_2, f"fsdp/{norm}"), f"fsdp/{norm}")


def test_fsdp_empty_local_shards(run_4: list[dict]) -> None:
    _assert_scenario(scenario_records(run_4, "uneven"), "uneven")


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_hsdp(run_4: list[dict], norm: str) -> None:
    _assert_scenario(scenario_records(run_4, f"hsdp/{norm}"), f"hsdp/{norm}")


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_fsdp_tp(run_4: list[dict], norm: str) -> None:
    _assert_scenario(scenario_records(run_4, f"fsdp_tp/{norm}"), f"fsdp_tp/{norm}")


def test_nonfinite(run_2: list[dict]) -> None:
    for rank, rec in enumerate(scenario_records(run_2, "nonfinite")):
        ours, theirs = rec["ours"], rec["torch"]
        assert theirs["error"] is not None and ours["error"] is not None, rank
        assert ours["error"][0] == theirs["error"][0] == "RuntimeError"
        assert ours["error"][1] == theirs["error"][1]  # torch's message, word for word
        assert ours["unchanged"] and theirs["unchanged"], "nothing scaled before the error"
        assert ours["norm_is_nan"] and theirs["norm_is_nan"]


def test_some_grads_none(run_2: list[dict]) -> None:
    for rank, rec in enumerate(scenario_records(run_2, "some_grads_none")):
        for impl in ("ours", "torch"):
            _assert_same_clip(rec[impl], f"rank {rank} {impl}")


def test_plain_tensors_mixed_in(run_2: list[dict]) -> None:
    for rec in scenario_records(run_2, "plain_mixed"):
        assert rec["torch_error"] is not None  # torch cannot mix DTensor and Tensor norms
        kind, _, value, _ = rec["ours"]
        assert kind == "DTensor"
        assert value == pytest.approx(rec["expected"], rel=NORM_RTOL)
        expected_grad = torch.full((5,), 0.5) * (MAX_NORM / (value + 1e-6))
        torch.testing.assert_close(rec["plain_grad"], expected_grad, rtol=2 * NORM_RTOL, atol=0)
        assert rec["comms"] == ONE_SCALAR_ALL_REDUCE


def test_foreach_false(run_2: list[dict]) -> None:
    for rank, rec in enumerate(scenario_records(run_2, "foreach_false")):
        _assert_same_clip(rec, f"rank {rank}")


def test_not_firing_leaves_grads_bitwise(run_2: list[dict]) -> None:
    for rank, rec in enumerate(scenario_records(run_2, "not_firing")):
        _assert_same_clip(rec, f"rank {rank}")
        for impl in ("ours", "torch"):
            for a, b in zip(rec[impl]["grads"], rec["before"], strict=True):
                assert torch.equal(a, b), f"rank {rank} {impl}"
