"""Graph mode's numerics on gloo: compiled without fusion (``aot_eager``) it trains
bitwise like our eager FSDP and torch's ``fully_shard`` (losses and local shards over
5 AdamW steps in fp32, W=2; HSDP 2x2; FSDP 2 x TP 2), with bucketing on; under bf16
mixed precision with gradient accumulation without sync, our clip_grad_norm_ and
local-shard optimizer step together (one compile for the four); with ``Shard(1)``
parameters;
with inductor, as close to eager as the plain model compiled the same way is to its
own eager run.

Why bitwise: graph mode's gather and reduction (dtensor_fsdp/graph/gather.py) do the
eager reduction's arithmetic in its order (gloo: all-to-all, then a sum of two terms,
then one division), and ``aot_eager`` runs the traced ATen ops as eager runs them.
Bucketing merges collectives, which sums the same terms elementwise.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fsdp
from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import Llama, apply_tensor_parallel
from dtensor_fsdp.optim import step_on_local_shards
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests._tiny_llama import uneven_config
from tests.graph._graphs import build_llama, llama_loss

STEPS = 5
LR = 1e-2


def _tokens(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 96, (2, 9), generator=generator)  # < every vocab_size here


def _train(
    model,
    rank: int,
    *,
    steps: int = STEPS,
    micro_batches: int = 1,
    clip: bool = False,
    local_step: bool = False,
    no_sync: bool = False,
) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if local_step:
        step_on_local_shards(optimizer)
    losses = []
    for step in range(steps):
        for micro in range(micro_batches):
            if no_sync:  # gradient accumulation without communication but the last
                model.set_requires_gradient_sync(micro == micro_batches - 1)
            loss = llama_loss(model, _tokens(rank, micro_batches * step + micro))
            loss.backward()
            losses.append(loss.item())
        if clip:
            dtensor_fsdp.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    params = {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {"losses": losses, "params": params}


def _three_ways(
    mesh, rank: int, *, mixed: bool = False, with_torch: bool = True, shard_dim1: bool = False,
    **train,
) -> dict:  # fmt: skip
    """Our eager, our graph mode (aot_eager, bucketing on), torch's eager."""
    config, layout = uneven_config(), {"mixed": mixed, "shard_dim1": shard_dim1}
    eager = _train(build_llama(config, mesh, **layout), rank, **train)
    torch._dynamo.reset()
    graph_model = build_llama(config, mesh, **layout)
    dtensor_fsdp.compile(graph_model, backend="aot_eager")
    records = {"eager": eager, "graph": _train(graph_model, rank, **train)}
    if with_torch:
        theirs = build_llama(config, mesh, **layout, impl=torch_fully_shard)
        records["torch"] = _train(theirs, rank, **train)
    return records


def _inductor_against_plain(mesh, rank: int) -> dict:
    """Loss and parameter distance to eager after 2 steps: ours (graph mode, inductor)
    and the plain model (inductor, single process on rank 0's batch)."""
    steps = 2
    eager = _train(build_llama(uneven_config(), mesh), rank, steps=steps)
    torch._dynamo.reset()
    graph_model = build_llama(uneven_config(), mesh)
    dtensor_fsdp.compile(graph_model, backend="inductor")
    graph = _train(graph_model, rank, steps=steps)
    # The plain model's distance is one computation (rank 0's batch, one thread per
    # rank): rank 0 runs it and tells rank 1, instead of both compiling it.
    plain = [_plain_distance(steps) if rank == 0 else None]
    dist.broadcast_object_list(plain, src=0)
    return {"ours": _distance(eager, graph), "plain": plain[0]}


def _plain_distance(steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    plain = Llama(uneven_config())
    torch.manual_seed(0)
    plain_compiled = Llama(uneven_config())
    plain_compiled.compile(backend="inductor", fullgraph=True)
    plain_eager = _train(plain, 0, steps=steps)
    plain_graph = _train(plain_compiled, 0, steps=steps)
    return _distance(plain_eager, plain_graph)


def _distance(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
    param = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
    return loss, param


def _scenarios(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "fp32": lambda: _three_ways(mesh, rank),
            # bf16 mixed precision, micro-batches without sync (summed in fp32: three
            # per step, so a pending sum grows over two before the syncing one), our
            # clip_grad_norm_ and local-shard step: one compile for the four.
            "bf16_no_sync_clip_local_step": lambda: _three_ways(
                mesh, rank, mixed=True, steps=3, micro_batches=3, no_sync=True, clip=True,
                local_step=True,
            ),  # fmt: skip
            # shard_placement_fn: every matrix Shard(1) (no padding; other chunking).
            "shard_dim1": lambda: _three_ways(mesh, rank, steps=2, shard_dim1=True),
        }
    )


def _inductor(rank: int, world_size: int) -> dict:
    # Its own run: the aot_eager scenarios run in the fast tier, inductor in the full
    # one only (tests/conftest.py).
    return _inductor_against_plain(init_device_mesh("cpu", (world_size,)), rank)


def _four_ranks(rank: int, world_size: int) -> dict:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # torch's HSDP and FSDP+TP are bitwise ours in eager (tests/runtime/scenarios/
    # test_scenarios_2d.py): graph mode against our eager is enough here.
    return run_scenarios(
        {
            "hsdp": lambda: _three_ways(hsdp, rank, with_torch=False),
            "tp": lambda: _tensor_parallel(tp),
        }
    )


def _tensor_parallel(mesh) -> dict:
    """FSDP over "dp" x TP over "tp" (Megatron-style, sequence parallel): our eager and
    graph mode (aot_eager), each TP pair on its data-parallel rank's tokens."""
    config = dataclasses.replace(uneven_config(), vocab_size=96)  # TP splits the vocabulary

    def build():
        torch.manual_seed(0)
        model = Llama(config)
        apply_tensor_parallel(model, mesh["tp"])
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model

    dp_rank = mesh["dp"].get_local_rank()
    eager = _train(build(), dp_rank, steps=3)
    torch._dynamo.reset()
    graph_model = build()
    dtensor_fsdp.compile(graph_model, backend="aot_eager")
    return {"eager": eager, "graph": _train(graph_model, dp_rank, steps=3)}


def _assert_bitwise(records: list[dict]) -> None:
    for rank, record in enumerate(records):
        eager = record["eager"]
        for other in set(record) - {"eager"}:
            assert record[other]["losses"] == eager["losses"], (rank, other)
            for name, value in eager["params"].items():
                assert torch.equal(record[other]["params"][name], value), (rank, other, name)


def test_graph_mode_trains_bitwise_like_eager(gloo_pool: GlooPools) -> None:
    run = run_distributed(_scenarios, 2, timeout=600, pool=gloo_pool)
    for name in ("fp32", "bf16_no_sync_clip_local_step", "shard_dim1"):
        _assert_bitwise(scenario_records(run, name))


def test_inductor_is_as_close_to_eager_as_the_plain_model(gloo_pool: GlooPools) -> None:
    # Inductor fuses and reorders fp32 arithmetic in graph mode as in the plain model:
    # ours may be as far from eager as the plain model compiled the same way is from
    # its eager run, times a margin for the 2 steps' different sums of sharded
    # arithmetic (AdamW normalizes updates, so rounding differences of gradients move
    # parameters by at most ~lr per step).
    for record in run_distributed(_inductor, 2, timeout=600, pool=gloo_pool):
        print("inductor distances (loss, param): ours", record["ours"], "plain", record["plain"])
        (ours_loss, ours_param), (plain_loss, plain_param) = record["ours"], record["plain"]
        assert ours_loss <= 10 * plain_loss + 1e-5, record
        assert ours_param <= 10 * plain_param + 3 * LR, record


def test_hsdp_and_tensor_parallel_train_bitwise_like_eager(gloo_pool: GlooPools) -> None:
    run = run_distributed(_four_ranks, 4, timeout=600, pool=gloo_pool)
    _assert_bitwise(scenario_records(run, "hsdp"))
    _assert_bitwise(scenario_records(run, "tp"))
