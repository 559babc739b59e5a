"""A list group partly run, torch's ``TestFullyShard1DTrainingCompose`` patterns, on
torch's ``fully_shard`` and ours on 2 gloo ranks: the chunked loss of large-vocabulary
training through ``fully_shard([norm, head])``.

The model is torch's test model: ``embed -> body -> norm -> head``, the root holding no
parameters of its own; with weight tying ``head.weight is embed.weight`` and the list
group is ``[embed, norm, head]``. A forward stops at the hidden states
(``model(tokens, skip_head=True)``, so the root's post-forward completes the partly run
group), then per chunk of the detached hidden states ``model.head(chunk)`` runs on its
own and its loss's ``backward()`` reduces the head's grads, then ``h.backward`` with the
chunks' input grads. See [Note: partly run list groups] (runtime/state.py).

Scenarios, each the same script on both implementations:

- ``chunked``: the grid of torch's ``test_partial_group_forward_then_standalone``:
  ``reshard_after_forward`` True, False and 1 (a post-forward mesh of one rank), tying,
  mixed precision (none; bf16 ``output_dtype`` on every group; on the list group only),
  and activation checkpointing (torch's composable ``checkpoint`` on the body);
- ``accumulation``: 3 micro-batches of 2 chunks, ``set_requires_gradient_sync`` and
  ``set_is_last_backward`` on the last only;
- ``toggle``: torchtitan's ``ChunkedCELoss``: the head's ``reshard_after_forward`` and
  ``reshard_after_backward`` off for the chunk loop, then restored and ``reshard()``;
- ``double``: two forwards that skip the head, then one backward of their sum;
- ``reset``: an exception inside a forward, ``reset_iter_state()``, then a step.

Compared with torch, bitwise (the same local arithmetic: for 2 ranks a sum of two
addends is the same in any order): every chunk's ``head.weight.grad`` right after its
backward (so a chunk whose grads land late or never shows), each chunk's loss and output
dtype, the hidden states' dtype, every local grad after ``h.backward``, the local shards
after each Adam step, and the c10d collectives of each phase (kind and bytes, in issue
order; ours' gloo reduce-scatter is an all-to-all, counted as a reduce-scatter).
"""

from collections.abc import Callable
from itertools import product
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import MixedPrecisionPolicy, fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

WORLD_SIZE = 2
DIM, VOCAB, CHUNKS, ITERS = 32, 128, 4, 2
IMPLS = {"ours": (fully_shard, MixedPrecisionPolicy), "torch": (torch_fully_shard, TorchMixedPrecisionPolicy)}

RESHARD = (True, False, 1)
MP_MODES = ("none", "bf16_everywhere", "bf16_inner_only")
CHUNKED = [
    *[(raf, tie, mp, False) for raf, tie, mp in product(RESHARD, (False, True), MP_MODES)],
    *[(raf, tie, "none", True) for raf, tie in product((True, False), (False, True))],
]


def _chunked_id(case: tuple) -> str:
    raf, tie, mp, ac = case
    return f"raf={raf}-tie={tie}-mp={mp}" + ("-ac" if ac else "")


class ChunkedHeadModel(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _build(
    impl: str, mesh: DeviceMesh, tie: bool, raf: bool | int = True, mp: str = "none", ac: bool = False
) -> tuple[ChunkedHeadModel, torch.optim.Optimizer]:
    """torch's ``_shard(grouped=True)`` layout, on the same initial values on both
    implementations."""
    shard, policy = IMPLS[impl]
    bf16_out = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
    inner = policy(**bf16_out) if mp != "none" else policy()
    root = policy(**bf16_out) if mp == "bf16_everywhere" else policy(param_dtype=torch.float32)
    torch.manual_seed(42)
    model = ChunkedHeadModel(tie)
    if ac:
        checkpoint(model.body)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": raf}
    if tie:
        shard(model.body, mp_policy=root, **kwargs)
        shard([model.embed, model.norm, model.head], mp_policy=inner, **kwargs)
    else:
        shard(model.embed, mp_policy=root, **kwargs)
        shard(model.body, mp_policy=root, **kwargs)
        shard([model.norm, model.head], mp_policy=inner, **kwargs)
    shard(model, mp_policy=root, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _tokens(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (2, 16), generator=generator)


def _collectives(recorder: C10dRecorder) -> list[tuple[str, int]]:
    return [
        ("reduce_scatter" if kind == "all_to_all" else kind, nbytes)
        for kind, nbytes in recorder.records
    ]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to_local().detach().clone()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: _local(p.grad) for name, p in model.named_parameters()}


def _shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def _chunk_loop(
    model: ChunkedHeadModel, head_weight: nn.Parameter, h: torch.Tensor, chunks: int
) -> tuple[list[dict], torch.Tensor]:
    """Each chunk's head forward and backward on its own; the chunks' input grads.
    ``head_weight``: the sharded param the optimizer holds (with reshard_after_backward
    off, the one registered between the chunks is the unsharded param, whose grad FSDP
    took)."""
    records, input_grads = [], []
    for chunk in torch.chunk(h.detach().float(), chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        with C10dRecorder() as recorder:
            out = model.head(chunk)
            loss = out.sum()
            loss.backward()
        input_grads.append(chunk.grad.detach())
        records.append(
            {
                "out_dtype": out.dtype,
                "loss": loss.item(),
                "head_grad": _local(head_weight.grad),
                "collectives": _collectives(recorder),
            }
        )
    return records, torch.cat(input_grads, dim=1)


def _chunked(impl: str, mesh: DeviceMesh, case: tuple) -> list[dict]:
    raf, tie, mp, ac = case
    model, optim = _build(impl, mesh, tie, raf, mp, ac)
    head_weight = model.head.weight
    steps = []
    for step in range(ITERS):
        with C10dRecorder() as forward:
            h = model(_tokens(step), skip_head=True)
        chunks, h_grad = _chunk_loop(model, head_weight, h, CHUNKS)
        with C10dRecorder() as backward:
            h.backward(h_grad.to(h.dtype))
        steps.append(
            {
                "h_dtype": h.dtype,
                "chunks": chunks,
                "grads": _grads(model),
                "collectives": (_collectives(forward), _collectives(backward)),
            }
        )
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        steps[-1]["shards"] = _shards(model)
    return steps


def _accumulation(impl: str, mesh: DeviceMesh, raf: bool, tie: bool) -> list[dict]:
    model, _ = _build(impl, mesh, tie, raf)
    head_weight = model.head.weight
    micro_batches = []
    for index in range(3):
        is_last = index == 2
        model.set_requires_gradient_sync(is_last)
        model.set_is_last_backward(is_last)
        h = model(_tokens(index), skip_head=True)
        chunks, h_grad = _chunk_loop(model, head_weight, h, 2)
        h.backward(h_grad)
        micro_batches.append({"chunks": chunks, "grads": _grads(model)})
    return micro_batches


def _toggle(impl: str, mesh: DeviceMesh, tie: bool, initial_reshard: bool) -> list[dict]:
    model, optim = _build(impl, mesh, tie, initial_reshard)
    head, head_weight = model.head, model.head.weight
    steps = []
    for step in range(3):
        h = model(_tokens(step), skip_head=True)
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        chunks, h_grad = _chunk_loop(model, head_weight, h, CHUNKS)
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.reshard()
        with C10dRecorder() as backward:
            h.backward(h_grad)
        steps.append({"chunks": chunks, "grads": _grads(model), "backward": _collectives(backward)})
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        steps[-1]["shards"] = _shards(model)
    return steps


def _double(impl: str, mesh: DeviceMesh) -> dict:
    model, _ = _build(impl, mesh, tie=False)
    with C10dRecorder() as recorder:
        h1 = model(_tokens(0), skip_head=True)
        h2 = model(_tokens(1), skip_head=True)
        (h1.sum() + h2.sum()).backward()
    return {"grads": _grads(model), "collectives": _collectives(recorder)}


class _Raiser(nn.Module):
    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


def _reset(impl: str, mesh: DeviceMesh) -> dict:
    shard, _ = IMPLS[impl]
    torch.manual_seed(42)
    model = ChunkedHeadModel(tie=False)
    model.body = _Raiser(model.body)
    shard([model.norm, model.head], mesh=mesh)
    shard(model, mesh=mesh)
    model.body.armed = True
    try:
        model(_tokens(0), skip_head=True)
    except RuntimeError as exc:
        raised = str(exc)
    model.body.armed = False
    model.reset_iter_state()
    model(_tokens(1)).sum().backward()
    return {"raised": raised, "grads": _grads(model)}


def _run(rank: int, world_size: int) -> dict[str, tuple[str, Any]]:
    mesh = init_device_mesh("cpu", (world_size,))
    scenarios: dict[str, Callable[[], Any]] = {}
    for impl in IMPLS:
        for case in CHUNKED:
            scenarios[f"chunked-{_chunked_id(case)}-{impl}"] = (
                lambda i=impl, c=case: _chunked(i, mesh, c)
            )
        for raf, tie in product((True, False), (False, True)):
            scenarios[f"accumulation-raf={raf}-tie={tie}-{impl}"] = (
                lambda i=impl, r=raf, t=tie: _accumulation(i, mesh, r, t)
            )
            scenarios[f"toggle-initial={raf}-tie={tie}-{impl}"] = (
                lambda i=impl, r=raf, t=tie: _toggle(i, mesh, t, r)
            )
        scenarios[f"double-{impl}"] = lambda i=impl: _double(i, mesh)
        scenarios[f"reset-{impl}"] = lambda i=impl: _reset(i, mesh)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(_run, WORLD_SIZE, timeout=300.0, pool=gloo_pool)


def _both(run: list, name: str) -> list[tuple[Any, Any]]:
    """Per rank, (ours, torch's) records of scenario ``name``."""
    return list(zip(scenario_records(run, f"{name}-ours"), scenario_records(run, f"{name}-torch")))


def _assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal structures; tensors bitwise (dtype and values), None where torch's is."""
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), where
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: {len(ours)} != {len(theirs)}"
        for index, (mine, torchs) in enumerate(zip(ours, theirs)):
            _assert_same(mine, torchs, f"{where}[{index}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {ours!r}"
        assert ours.dtype == theirs.dtype, f"{where}: {ours.dtype} != {theirs.dtype}"
        assert torch.equal(ours, theirs), f"{where}: max diff {(ours - theirs).abs().max()}"
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _assert_every_chunk_contributes(chunks: list[dict], where: str) -> None:
    """Torch's check, on ours: each chunk's backward changes ``head.weight.grad``."""
    for index in range(1, len(chunks)):
        delta = chunks[index]["head_grad"] - chunks[index - 1]["head_grad"]
        assert delta.norm() > 0, f"{where}: chunk {index} did not contribute to head.weight.grad"


@pytest.mark.parametrize("case", CHUNKED, ids=_chunked_id)
def test_chunked_loss_matches_torch(run, case) -> None:
    for rank, (ours, theirs) in enumerate(_both(run, f"chunked-{_chunked_id(case)}")):
        for step, record in enumerate(ours):
            _assert_every_chunk_contributes(record["chunks"], f"rank {rank} step {step}")
        _assert_same(ours, theirs, f"rank {rank}")


@pytest.mark.parametrize("raf", [True, False], ids=lambda raf: f"raf={raf}")
@pytest.mark.parametrize("tie", [False, True], ids=lambda tie: f"tie={tie}")
def test_chunked_loss_accumulation_matches_torch(run, raf, tie) -> None:
    for rank, (ours, theirs) in enumerate(_both(run, f"accumulation-raf={raf}-tie={tie}")):
        # No grads before the last micro-batch's reduction, as torch's (None on both).
        assert all(g is None for g in ours[0]["grads"].values()), f"rank {rank}"
        assert all(g is not None for g in ours[-1]["grads"].values()), f"rank {rank}"
        _assert_same(ours, theirs, f"rank {rank}")


@pytest.mark.parametrize("initial", [True, False], ids=lambda r: f"initial={r}")
@pytest.mark.parametrize("tie", [False, True], ids=lambda tie: f"tie={tie}")
def test_chunked_loss_reshard_toggle_matches_torch(run, initial, tie) -> None:
    for rank, (ours, theirs) in enumerate(_both(run, f"toggle-initial={initial}-tie={tie}")):
        for step, record in enumerate(ours):
            _assert_every_chunk_contributes(record["chunks"], f"rank {rank} step {step}")
            # Kept unsharded through the loop: only the first chunk all-gathers.
            gathers = [
                sum(kind == "all_gather" for kind, _ in chunk["collectives"])
                for chunk in record["chunks"]
            ]
            assert gathers[1:] == [0] * (CHUNKS - 1), f"rank {rank} step {step}: {gathers}"
        _assert_same(ours, theirs, f"rank {rank}")


def test_two_partial_forwards_then_one_backward_match_torch(run) -> None:
    for rank, (ours, theirs) in enumerate(_both(run, "double")):
        assert ours["grads"]["head.weight"] is None, f"rank {rank}: the head never ran"
        _assert_same(ours, theirs, f"rank {rank}")


def test_reset_iter_state_after_an_exception_in_a_partial_forward(run) -> None:
    for rank, (ours, theirs) in enumerate(_both(run, "reset")):
        assert ours["raised"] == "boom", f"rank {rank}"
        assert all(g is not None for g in ours["grads"].values()), f"rank {rank}"
        _assert_same(ours, theirs, f"rank {rank}")
