"""Graph mode composes with the eager runtime's features: each configuration trains
bitwise like eager mode with ``backend="aot_eager"`` (bucketing on), 3 AdamW steps, in
fp32 or under bf16 mixed precision (``param_dtype`` bf16, ``reduce_dtype`` fp32): losses
and local shards after every step.

One precision per feature (`PRECISION`), since each compile of the Llama costs ~5 CPU-s
per rank: for a feature whose communication arithmetic tests/graph/test_conformance.py
checks (offload, quantized wires, custom strategies, the process group's allocation,
the all-reduce hook, HSDP's replicate leg and all-reduce), the precision that table
does not run it in, so that the two files together run each in both; the features of
the graph's structure (a registered method, a list group, a block called twice,
disabling, GPT-2, hpZ) alternate.

On 2 gloo ranks: CPU offload; quantized communication (int8 all-gather and
reduce-scatter with error feedback); custom all-gather and reduce-scatter strategies;
the process group's allocator (``set_allocate_memory_from_process_group_for_comm``);
the all-reduce hook; a ``register_fsdp_forward_method`` method; a list group
``fully_shard([norm, output])``; a block called twice per forward; ``disable_graph_mode``
after two steps (the third eager); Hugging Face's ``GPT2LMHeadModel`` (its ``forward``
logs with ``warning_once``). On 4: HSDP 2 x 2 with quantized replicate leg
(``replicate_only``) and with ``set_requires_all_reduce(False)`` on all but the last
micro-batch; hpZ (``reshard_after_forward=2``).

Why bitwise: both executors run one description with the same arithmetic
(tests/graph/test_conformance.py), and ``aot_eager`` runs the traced ATen ops as eager
runs them; each reduction sums 2 ranks' terms (a + b == b + a exactly), and where
graph mode gathers a group once instead of twice (a block called twice, hpZ's two
stages) the gathered values are the same copies.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dtensor_fsdp
from dtensor_fsdp import (
    AllGather,
    CommPrecisionPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ReduceScatter,
    fully_shard,
)
from dtensor_fsdp.models.llama import Llama, cross_entropy_loss
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests._tiny_llama import uneven_config

STEPS = 3
LR = 1e-2
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
Build = Callable[[DeviceMesh, MixedPrecisionPolicy | None], nn.Module]


def _tokens(rank: int, step: int, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, vocab, (2, 9), generator=generator)


def _llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _llama(
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy | None,
    *,
    list_group: bool = False,
    reshard_after_forward: bool | int = True,
    **kwargs: Any,
) -> nn.Module:
    """The uneven Llama (2 blocks, then the root), each ``fully_shard`` with ``kwargs``."""
    torch.manual_seed(0)
    model = Llama(uneven_config())
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    if list_group:
        fully_shard([model.norm, model.output], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, dtensor_fsdp.FSDPModule)]


class _GatherBySum(AllGather):
    """A custom all-gather that computes it another way: an all-reduce of a zero
    buffer holding this rank's input at its place (exact: one term is nonzero)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rank, size = group.rank(), group.size()
        rows = output_tensor.view(size, -1)
        rows.zero_()
        rows[rank].copy_(input_tensor)
        # bytes: sum as int32 words would carry; uint8 SUM of one nonzero term is exact.
        return dist.all_reduce(output_tensor, group=group, async_op=async_op)


class _ReduceScatterByAllReduce(ReduceScatter):
    """A custom reduce-scatter: an all-reduce of the whole input, then this rank's chunk."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        total = input_tensor.clone()
        dist.all_reduce(total, op=op, group=group)
        output_tensor.copy_(total.view(group.size(), -1)[group.rank()])
        return None


def _configure(build: Build, setup: Callable[[nn.Module], None]) -> Build:
    def configured(mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> nn.Module:
        model = build(mesh, mp)
        setup(model)
        return model

    return configured


def _comm_precision(model: nn.Module) -> None:
    model.set_comm_precision(
        CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8", error_feedback=True)
    )


def _custom_comms(model: nn.Module) -> None:
    for module in _fsdp_modules(model):
        module.set_custom_all_gather(_GatherBySum())
        module.set_custom_reduce_scatter(_ReduceScatterByAllReduce())


def _allocate_from_process_group(model: nn.Module) -> None:
    for module in _fsdp_modules(model):
        module.set_allocate_memory_from_process_group_for_comm(True)


def _hook(model: nn.Module) -> None:
    for module in _fsdp_modules(model):
        module.set_all_reduce_hook(lambda reduced: reduced.mul_(0.75))


class _Scored(nn.Module):
    """A method that runs the forward (a generate()-like caller), registered."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        return self(tokens) * 0.5


def _scored(mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> nn.Module:
    torch.manual_seed(0)
    inner = Llama(uneven_config())
    for block in inner.layers:
        fully_shard(block, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    model = fully_shard(_Scored(inner), mesh=mesh, **({"mp_policy": mp} if mp else {}))
    dtensor_fsdp.register_fsdp_forward_method(model, "score")
    return model


class _Twice(nn.Module):
    """Residual blocks, the middle one called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(96, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 65), nn.ReLU(), nn.Linear(65, 32)) for _ in range(3)
        )
        self.head = nn.Linear(32, 96)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in (self.blocks[0], self.blocks[1], self.blocks[1], self.blocks[2]):
            h = h + block(h)
        return self.head(h)


def _twice(mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> nn.Module:
    torch.manual_seed(0)
    model = _Twice()
    kwargs = {"mp_policy": mp} if mp else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _gpt2(mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    kwargs = {"mp_policy": mp} if mp else {}
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _gpt2_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _train(
    model: nn.Module,
    rank: int,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    micro_batches: tuple[tuple[bool, bool], ...] = ((True, True),),
    after_step: Callable[[nn.Module, int], None] | None = None,
) -> dict:
    """``STEPS`` AdamW steps; per step its micro-batches as (requires_gradient_sync,
    requires_all_reduce), set before each forward. Losses, and local shards after each
    step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, params = [], []
    for step in range(STEPS):
        for micro, (sync, all_reduce) in enumerate(micro_batches):
            model.set_requires_gradient_sync(sync)
            model.set_requires_all_reduce(all_reduce)
            loss = loss_fn(model, _tokens(rank, len(micro_batches) * step + micro))
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        params.append({n: p.to_local().detach().clone() for n, p in model.named_parameters()})
        if after_step is not None:
            after_step(model, step)
    return {"losses": losses, "params": params}


# The conformance table's precision for the feature is the other one (docstring).
PRECISION = {
    "cpu_offload": "fp32",  # conformance: offload under bf16 mixed precision
    "comm_precision": "bf16",  # conformance: int8 wires on fp32
    "custom_comms": "bf16",  # conformance: custom strategies on fp32
    "process_group_allocation": "fp32",  # conformance: under mixed precision
    "all_reduce_hook": "bf16",  # conformance: the hook on fp32
    "registered_method": "fp32",
    "list_group": "bf16",
    "block_called_twice": "fp32",
    "disable_graph_mode": "bf16",
    "gpt2": "fp32",
    "hsdp_quantized_replicate_leg": "bf16",  # conformance: replicate_only on fp32
    "hsdp_all_reduce_on_the_last_micro_batch": "bf16",  # conformance: on fp32
    "hpz": "bf16",  # the 1/k copies hold the bf16 unsharded params
}
POLICIES = {"fp32": None, "bf16": MP}


def _eager_and_graph(
    feature: str,
    build: Build,
    mesh: DeviceMesh,
    rank: int,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _llama_loss,
    after_step: Callable[[nn.Module, int], None] | None = None,
    **train: Any,
) -> dict:
    """The feature's precision (`PRECISION`), trained eager and in graph mode;
    ``after_step`` in graph mode only."""
    mp = POLICIES[PRECISION[feature]]
    eager = _train(build(mesh, mp), rank, loss_fn, **train)
    torch._dynamo.reset()
    graph_model = build(mesh, mp)
    dtensor_fsdp.compile(graph_model, backend="aot_eager")
    graph = _train(graph_model, rank, loss_fn, after_step=after_step, **train)
    return {PRECISION[feature]: {"eager": eager, "graph": graph}}


def _disable_after_two_steps(mesh: DeviceMesh, rank: int) -> dict:
    """Graph mode for 2 steps, then ``disable_graph_mode`` and an eager third step,
    against 3 eager steps."""

    def disable(model: nn.Module, step: int) -> None:
        if step == 1:
            dtensor_fsdp.disable_graph_mode(model)

    return _eager_and_graph("disable_graph_mode", _llama, mesh, rank, after_step=disable)


def _scored_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model.score(tokens[:, :-1]), tokens[:, 1:])


def _two_ranks(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "cpu_offload": lambda: _eager_and_graph(
                "cpu_offload",
                lambda m, mp: _llama(m, mp, offload_policy=CPUOffloadPolicy(pin_memory=False)),
                mesh,
                rank,
            ),
            "comm_precision": lambda: _eager_and_graph(
                "comm_precision", _configure(_llama, _comm_precision), mesh, rank
            ),
            "custom_comms": lambda: _eager_and_graph(
                "custom_comms", _configure(_llama, _custom_comms), mesh, rank
            ),
            "process_group_allocation": lambda: _eager_and_graph(
                "process_group_allocation",
                _configure(_llama, _allocate_from_process_group),
                mesh,
                rank,
            ),
            "all_reduce_hook": lambda: _eager_and_graph(
                "all_reduce_hook", _configure(_llama, _hook), mesh, rank
            ),
            "registered_method": lambda: _eager_and_graph(
                "registered_method", _scored, mesh, rank, _scored_loss
            ),
            "list_group": lambda: _eager_and_graph(
                "list_group", lambda m, mp: _llama(m, mp, list_group=True), mesh, rank
            ),
            "block_called_twice": lambda: _eager_and_graph(
                "block_called_twice",
                _twice,
                mesh,
                rank,
                lambda m, t: cross_entropy_loss(m(t[:, :-1]), t[:, 1:]),
            ),
            "disable_graph_mode": lambda: _disable_after_two_steps(mesh, rank),
            "gpt2": lambda: _eager_and_graph("gpt2", _gpt2, mesh, rank, _gpt2_loss),
        }
    )


def _four_ranks(rank: int, world_size: int) -> dict:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (world_size,))
    replicate_only = CommPrecisionPolicy(reduce_scatter="bf16", replicate_only=True)
    return run_scenarios(
        {
            "hsdp_quantized_replicate_leg": lambda: _eager_and_graph(
                "hsdp_quantized_replicate_leg",
                _configure(_llama, lambda m: m.set_comm_precision(replicate_only)),
                hsdp,
                rank,
            ),
            "hsdp_all_reduce_on_the_last_micro_batch": lambda: _eager_and_graph(
                "hsdp_all_reduce_on_the_last_micro_batch",
                _llama,
                hsdp,
                rank,
                micro_batches=((True, False), (True, False), (True, True)),
            ),
            "hpz": lambda: _eager_and_graph(
                "hpz", lambda m, mp: _llama(m, mp, reshard_after_forward=2), flat, rank
            ),
        }
    )


TWO_RANKS = (
    "cpu_offload", "comm_precision", "custom_comms", "process_group_allocation",
    "all_reduce_hook", "registered_method", "list_group", "block_called_twice",
    "disable_graph_mode", "gpt2",
)  # fmt: skip
FOUR_RANKS = ("hsdp_quantized_replicate_leg", "hsdp_all_reduce_on_the_last_micro_batch", "hpz")


@pytest.fixture(scope="module")
def two_ranks(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_two_ranks, 2, timeout=1800, pool=gloo_pool)


@pytest.fixture(scope="module")
def four_ranks(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_four_ranks, 4, timeout=1800, pool=gloo_pool)


def _assert_bitwise(records: list[dict]) -> None:
    for rank, record in enumerate(records):
        for dtype, runs in record.items():
            eager, graph = runs["eager"], runs["graph"]
            assert graph["losses"] == eager["losses"], (rank, dtype)
            for step, (ours, theirs) in enumerate(
                zip(graph["params"], eager["params"], strict=True)
            ):
                for name, value in theirs.items():
                    assert torch.equal(ours[name], value), (rank, dtype, step, name)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_trains_bitwise_like_eager_on_two_ranks(two_ranks, name: str) -> None:
    _assert_bitwise(scenario_records(two_ranks, name))


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_trains_bitwise_like_eager_on_four_ranks(four_ranks, name: str) -> None:
    _assert_bitwise(scenario_records(four_ranks, name))
