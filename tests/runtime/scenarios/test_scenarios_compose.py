"""Training recipes that compose FSDP with other features, torch's
``test_fully_shard_training.py`` (the parts ``test_scenarios_training.py`` and
``test_scenarios_list_groups.py`` leave out) and ``test_fully_shard_clip_grad_norm_.py``,
on torch's ``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

Per training step both sides record the loss, the c10d collectives, every local grad
and every local shard after an Adam step, compared bitwise:

- ``single_group``: one group (the root only) over Linears whose dims do not divide by
  2, or sharded on each parameter's largest dim (torch's
  ``test_train_parity_single_group_shard_*``);
- ``ac``: activation checkpointing (composable ``checkpoint``, ``torch.utils.checkpoint``
  inside the blocks, ``checkpoint_wrapper``) with three groupings: a group per block;
  torch's memory-efficient one (list groups, the embeddings' group with
  ``set_unshard_in_backward(False)``); list-grouped tied embedding and output (torch's
  ``test_train_parity_with_activation_checkpointing``);
- ``dpo``: nested groups and activation checkpointing, two forwards before one backward
  of a loss combining both (torch's ``test_double_forward_with_nested_fsdp_and_checkpoint``);
- ``non_root``: a step through the root, then a forward and backward through one
  block alone (torch's ``test_non_root_forward_backward``);
- ``one_f_one_b``: micro-batches with gradient sync and the last backward only at the
  end, optionally all groups unsharded up front, ``set_reshard_after_backward`` off
  until the end (torch's ``test_1f1b_microbatching``);
- ``forward_method``: a child run through a method other than ``forward``, registered
  with ``register_fsdp_forward_method`` (torch's ``test_register_fsdp_forward_method``);
- ``tied``: the embedding tied to the output projection in the root's group, with and
  without activation checkpointing (torch's ``test_train_parity_with_shared_params``),
  and in a list group with an odd vocabulary (torch's
  ``test_train_shared_params_uneven_shard``: every row must train);
- ``layer_by_layer``: blocks created, sharded and garbage-collected one at a time
  (torch's ``test_layer_by_layer_shard_no_false_positive``);
- ``contiguous``: parameters sharded on dim 1 stay contiguous, as do their grads
  (torch's ``test_shard_placement_fn_contiguous_params_grads``);
- ``cpu_offload``: ``CPUOffloadPolicy`` (torch's
  ``test_train_parity_multi_group_cpu_offload_eager``);
- ``clip``: ``torch.nn.utils.clip_grad_norm_`` on the sharded grads for norm types 2, 1
  and inf (torch's ``test_clip_grad_norm_1d``): the total norm and the clipped grads;
- ``ddp_ignored``: DDP over a model whose middle part is sharded with a submodule's
  parameters left to DDP through ``ignored_params`` (torch's
  ``test_fully_shard_ignore_params.py``, ``test_ddp_A_fsdp_B_ddp_C``).
"""

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from tests.runtime.scenarios._blocks import DIM, SEQ, VOCAB, Block, Stack, TokenModel
from tests.runtime.scenarios._side_by_side import (
    Side,
    cases_fixture,
    checked,
    local,
    local_grads,
    local_shards,
    rank_input,
    rank_tokens,
    train,
)

ROWS, STEPS = 4, 3


def _tokens_loss(model: nn.Module) -> Callable[[int], torch.Tensor]:
    return lambda step: model(rank_tokens(step, VOCAB, ROWS, SEQ)).sum()


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


# ---------------------------------------------------------------------------
# One group; activation checkpointing and groupings
# ---------------------------------------------------------------------------

SINGLE_GROUP = [((16, 15), (15, 8), False), ((7, 15), (15, 3), False), ((16, 17), (17, 8), False)]
SINGLE_GROUP += [((32, 16), (16, 8), True)]


def _single_group(
    side: Side, mesh: DeviceMesh, first: tuple, second: tuple, largest: bool
) -> list[dict]:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*first), nn.ReLU(), nn.Linear(*second))
    side.fully_shard(model, mesh=mesh, shard_placement_fn=_largest_dim if largest else None)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, first[0])).sum())


def _ac(side: Side, mesh: DeviceMesh, raf: bool, how: str, grouping: str) -> list[dict]:
    torch.manual_seed(42)
    model = TokenModel(tie=grouping != "mem_eff", utils_ac=how == "utils")  # torch's choice
    if how == "wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    elif how == "composable":
        for layer in model.layers:
            composable_checkpoint(layer)
    layers = list(model.layers)
    kwargs = {"mesh": mesh, "reshard_after_forward": raf}
    if grouping == "mem_eff":
        side.fully_shard(layers[0], **kwargs)
        side.fully_shard(layers[1:], **kwargs)
        side.fully_shard([model.tok, model.pos], **kwargs)
        model.tok.set_unshard_in_backward(False)  # an embedding's backward needs no weight
        side.fully_shard([model.norm, model.output], **kwargs)
    elif grouping == "mem_eff_tied":
        side.fully_shard([model.tok, model.output], **kwargs)
        for layer in layers:
            side.fully_shard(layer, **kwargs)
    else:
        for layer in layers:
            side.fully_shard(layer, **kwargs)
    side.fully_shard(model, **kwargs)
    return train(model, STEPS, _tokens_loss(model))


def _dpo(side: Side, mesh: DeviceMesh, raf: bool, how: str) -> list[dict]:
    torch.manual_seed(42)
    model = TokenModel(utils_ac=how == "utils")
    for layer in model.layers:
        if how == "composable":
            composable_checkpoint(layer)
        side.fully_shard(layer.ff, mesh=mesh, reshard_after_forward=raf)
        side.fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)

    def loss(step: int) -> torch.Tensor:
        chosen = model(rank_tokens(step, VOCAB, ROWS, SEQ))
        rejected = model(rank_tokens(100 + step, VOCAB, ROWS, SEQ))
        return (chosen.mean() - rejected.mean()).square()

    return train(model, STEPS, loss)


# ---------------------------------------------------------------------------
# Forward/backward patterns
# ---------------------------------------------------------------------------


def _sharded_stack(side: Side, mesh: DeviceMesh, **kwargs: Any) -> Stack:
    torch.manual_seed(42)
    model = Stack(3)
    for block in model.blocks:
        side.fully_shard(block, mesh=mesh, **kwargs)
    side.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _non_root(side: Side, mesh: DeviceMesh) -> list[dict]:
    model = _sharded_stack(side, mesh)

    def loss(step: int) -> torch.Tensor:
        if step % 2 == 0:
            return model(rank_input(step, ROWS, DIM)).sum()
        return model.blocks[0](rank_input(step, ROWS, DIM)).sum()  # a non-root alone

    return train(model, 2 * STEPS, loss)


def _one_f_one_b(
    side: Side, mesh: DeviceMesh, explicit_unshard: bool, reshard_after_backward: bool
) -> list[dict]:
    model = _sharded_stack(side, mesh, reshard_after_forward=False)
    micro_batches = 3

    def loss(step: int) -> torch.Tensor:
        if explicit_unshard:  # issue every all-gather up front, as a pipeline might
            for module in model.modules():
                if isinstance(module, side.FSDPModule):
                    module.unshard(async_op=True)
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            if not reshard_after_backward:
                model.set_reshard_after_backward(last)
            out = model(rank_input(10 * step + micro, ROWS, DIM)).sum()
            if last:
                return out
            out.backward()
        raise AssertionError("unreachable")

    return train(model, STEPS, loss)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(DIM, 2 * DIM)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch(x).relu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x).sum(dim=1)


class WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.projector = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder.forward_features(x))  # not encoder.forward


def _forward_method(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = WithEncoder()
    for module in (model.encoder, model.projector, model):
        side.fully_shard(module, mesh=mesh)
    side.register_fsdp_forward_method(model.encoder, "forward_features")
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, 3, DIM)).sum())


# ---------------------------------------------------------------------------
# Shared parameters; sharding one block at a time
# ---------------------------------------------------------------------------


def _tied(side: Side, mesh: DeviceMesh, raf: bool, ac: bool) -> list[dict]:
    torch.manual_seed(42)
    model = TokenModel(tie=True)
    for layer in model.layers:
        if ac:
            composable_checkpoint(layer)
        side.fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return train(model, STEPS, _tokens_loss(model))


ODD_VOCAB = 2 * 4 + 1  # rank 1's shard of the tied weight is one row short (padded)


def _tied_uneven(side: Side, mesh: DeviceMesh, raf: bool) -> dict:
    torch.manual_seed(42)
    model = TokenModel(blocks=1, tie=True, vocab=ODD_VOCAB)
    side.fully_shard([model.tok, model.output], mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    before = local(model.tok.weight)

    def loss(step: int) -> torch.Tensor:
        ids = rank_tokens(step, ODD_VOCAB, ROWS, SEQ)
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    steps = train(model, 5, loss)
    return {"steps": steps, "rows_changed": (local(model.tok.weight) != before).any(dim=1).tolist()}


def _layer_by_layer(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = Stack(0)
    for _ in range(4):  # build, shard, collect: ids of freed params get reused
        block = Block()
        model.blocks.append(block)
        side.fully_shard(block, mesh=mesh)
        gc.collect()
    side.fully_shard(model, mesh=mesh)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


def _contiguous(side: Side, mesh: DeviceMesh) -> dict:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))

    def on_dim1(param: nn.Parameter) -> Shard:
        return Shard(1) if param.ndim > 1 else Shard(0)

    for module in (model[0], model[2], model):
        side.fully_shard(module, mesh=mesh, shard_placement_fn=on_dim1)
    seen: list = []
    for linear in (model[0], model[2]):
        linear.register_forward_pre_hook(
            lambda m, _: seen.append([p.is_contiguous() for p in m.parameters()])
        )
    steps = train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())
    flags = [
        (
            p.is_contiguous(),
            p.to_local().is_contiguous(),
            p.grad is None or p.grad.to_local().is_contiguous(),
        )
        for p in model.parameters()
    ]
    return {"steps": steps, "unsharded_contiguous": seen, "sharded_contiguous": flags}


def _cpu_offload(side: Side, mesh: DeviceMesh) -> list[dict]:
    model = _sharded_stack(side, mesh, offload_policy=side.CPUOffloadPolicy(pin_memory=False))
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


def _clip(side: Side, mesh: DeviceMesh, norm_type: float) -> list[dict]:
    model = _sharded_stack(side, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        model(rank_input(step, ROWS, DIM)).sum().backward()
        before = local_grads(model)
        total = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm=0.5, norm_type=norm_type
        )
        steps.append(
            {"grads_before": before, "total_norm": local(total), "grads": local_grads(model)}
        )
        optim.step()
        optim.zero_grad()
        steps[-1]["shards"] = local_shards(model)
    return steps


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(DIM, DIM)  # left to DDP
        self.shift = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.c(x)) - self.shift


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.offset = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) + self.offset).tanh().sum()


def _ddp_ignored(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = Outer()
    ignored = set(model.inner.c.parameters())
    side.fully_shard(model.inner.lin_b, mesh=mesh, ignored_params=ignored)
    side.fully_shard(model.inner, mesh=mesh, ignored_params=ignored)
    fsdp_managed = [
        f"inner.{name}" for name, p in model.inner.named_parameters() if p not in ignored
    ]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, fsdp_managed)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    return train(ddp, STEPS, lambda step: ddp(rank_input(step, DIM, DIM)))


# ---------------------------------------------------------------------------
# The spawn
# ---------------------------------------------------------------------------

AC = [
    (raf, how, g)
    for raf in (True, False)
    for how in ("composable", "utils", "wrapper")
    for g in ("block", "mem_eff", "mem_eff_tied")
]
DPO = [(raf, how) for raf in (True, False) for how in ("composable", "utils")]
ONE_F_ONE_B = [(explicit, rab) for explicit in (False, True) for rab in (False, True)]
NORM_TYPES = (2.0, 1.0, float("inf"))


def _ac_id(raf: bool, how: str, grouping: str) -> str:
    return f"ac-raf={raf}-{how}-{grouping}"


def _dpo_id(raf: bool, how: str) -> str:
    return f"dpo-raf={raf}-{how}"


def _1f1b_id(explicit: bool, rab: bool) -> str:
    return f"one_f_one_b-explicit_unshard={explicit}-rab={rab}"


def _single_id(first: tuple, second: tuple, largest: bool) -> str:
    return f"single_group-{first}-{second}-largest_dim={largest}".replace(" ", "")


CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {
    "non_root": _non_root,
    "forward_method": _forward_method,
    "layer_by_layer": _layer_by_layer,
    "contiguous": _contiguous,
    "cpu_offload": _cpu_offload,
    "ddp_ignored": _ddp_ignored,
}
for _case in SINGLE_GROUP:
    CASES[_single_id(*_case)] = lambda s, m, c=_case: _single_group(s, m, *c)
for _case in AC:
    CASES[_ac_id(*_case)] = lambda s, m, c=_case: _ac(s, m, *c)
for _case in DPO:
    CASES[_dpo_id(*_case)] = lambda s, m, c=_case: _dpo(s, m, *c)
for _case in ONE_F_ONE_B:
    CASES[_1f1b_id(*_case)] = lambda s, m, c=_case: _one_f_one_b(s, m, *c)
for _raf in (True, False):
    for _ac_on in (False, True):
        CASES[f"tied-raf={_raf}-ac={_ac_on}"] = lambda s, m, r=_raf, a=_ac_on: _tied(s, m, r, a)
    CASES[f"tied_uneven-raf={_raf}"] = lambda s, m, r=_raf: _tied_uneven(s, m, r)
for _norm in NORM_TYPES:
    CASES[f"clip-{_norm}"] = lambda s, m, n=_norm: _clip(s, m, n)


run = cases_fixture(__name__)


@pytest.mark.parametrize(
    "first,second,largest",
    SINGLE_GROUP,
    ids=[_single_id(*c).split("-", 1)[1] for c in SINGLE_GROUP],
)
def test_single_group_matches_torch(run, first, second, largest) -> None:
    checked(run, _single_id(first, second, largest))


@pytest.mark.parametrize("raf,how,grouping", AC, ids=[_ac_id(*c).removeprefix("ac-") for c in AC])
def test_activation_checkpointing_and_groupings_match_torch(run, raf, how, grouping) -> None:
    for ours, _ in checked(run, _ac_id(raf, how, grouping)):
        assert all(g is not None for g in ours[0]["grads"].values())


@pytest.mark.parametrize("raf,how", DPO, ids=[_dpo_id(*c).removeprefix("dpo-") for c in DPO])
def test_two_forwards_with_nested_groups_and_checkpointing_match_torch(run, raf, how) -> None:
    checked(run, _dpo_id(raf, how))


def test_forward_and_backward_through_a_non_root_match_torch(run) -> None:
    for ours, _ in checked(run, "non_root"):
        # The non-root steps give grads to block 0 only (the rest keep zeros or None).
        assert ours[1]["grads"]["blocks.0.ff.w1.weight"] is not None


@pytest.mark.parametrize(
    "explicit,rab",
    ONE_F_ONE_B,
    ids=[_1f1b_id(*c).removeprefix("one_f_one_b-") for c in ONE_F_ONE_B],
)
def test_micro_batches_with_sync_on_the_last_match_torch(run, explicit, rab) -> None:
    checked(run, _1f1b_id(explicit, rab))


def test_registered_forward_method_matches_torch(run) -> None:
    checked(run, "forward_method")


@pytest.mark.parametrize("ac", [False, True], ids=lambda a: f"ac={a}")
@pytest.mark.parametrize("raf", [True, False], ids=lambda r: f"raf={r}")
def test_tied_embedding_and_output_match_torch(run, raf, ac) -> None:
    checked(run, f"tied-raf={raf}-ac={ac}")


@pytest.mark.parametrize("raf", [True, False], ids=lambda r: f"raf={r}")
def test_tied_weight_sharded_unevenly_trains_every_row_like_torch(run, raf) -> None:
    for ours, _ in checked(run, f"tied_uneven-raf={raf}"):
        assert all(ours["rows_changed"]), ours["rows_changed"]


def test_blocks_sharded_one_at_a_time_match_torch(run) -> None:
    checked(run, "layer_by_layer")


def test_dim1_shards_and_their_grads_stay_contiguous_like_torch(run) -> None:
    for ours, _ in checked(run, "contiguous"):
        assert all(all(flags) for flags in ours["unsharded_contiguous"])
        assert all(all(flags) for flags in ours["sharded_contiguous"])


def test_cpu_offload_matches_torch(run) -> None:
    checked(run, "cpu_offload")


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_torch_clip_grad_norm_on_sharded_grads_matches_torch(run, norm_type) -> None:
    for ours, _ in checked(run, f"clip-{norm_type}"):
        for step in ours:
            assert step["total_norm"] > 0.5  # clipping fired
            assert any(
                not torch.equal(step["grads"][n], g) for n, g in step["grads_before"].items()
            )


def test_ddp_over_a_sharded_part_with_ignored_params_matches_torch(run) -> None:
    for ours, _ in checked(run, "ddp_ignored"):
        # DDP's params (offset, c's) are plain tensors, FSDP's sharded; every one trains.
        assert all(g is not None for g in ours[0]["grads"].values())
