"""Shared by the N-D mesh parity tests (``test_hsdp.py``, ``test_tp.py``).

Child side: ``train_against_reference`` trains a sharded model on this rank's slice and
a single-process copy on the global batch in lockstep, recording per step the losses,
the clipped total grad norms, and ``full_tensor()`` grads and params next to the
reference's; ``local_pairs`` records this rank's local shards (or grads) next to torch's
``fully_shard``'s. Parent side: ``assert_pairs_close`` and ``assert_train_parity``.

Records hold plain tensors and floats only, so they pickle back to the parent.
"""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ATOL = RTOL = 1e-5
CLIP_MAX_NORM = 0.05  # below the test models' gradient norms, so clipping always fires

# A pair is (ours, reference) for one parameter FQN.
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
Batch = tuple[torch.Tensor, torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_pairs(model: nn.Module, ref: nn.Module, *, grads: bool) -> Pairs:
    """Per FQN, ``full_tensor()`` of our param (or grad) and the reference's."""
    ref_params = dict(ref.named_parameters())
    pairs = {}
    for name, p in model.named_parameters():
        ours, theirs = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name])
        assert ours is not None and theirs is not None, (
            f"no {'grad' if grads else 'param'} for {name}"
        )
        pairs[name] = (full(ours), theirs.detach().clone())
    return pairs


def local_pairs(ours: nn.Module, theirs: nn.Module, *, grads: bool) -> Pairs:
    """Per FQN, this rank's local shard (or local grad) of ours and of torch's."""
    their_params = dict(theirs.named_parameters())
    pairs = {}
    for name, p in ours.named_parameters():
        a, b = (p.grad, their_params[name].grad) if grads else (p, their_params[name])
        pairs[name] = (a.to_local().detach().clone(), b.to_local().detach().clone())
    return pairs


def placements(model: nn.Module) -> dict[str, tuple]:
    """Per FQN: (placements, local shape), or None for a parameter that is not a DTensor."""
    return {
        name: (tuple(p.placements), tuple(p.to_local().shape)) if isinstance(p, DTensor) else None
        for name, p in model.named_parameters()
    }


def mean_over_world(loss: torch.Tensor) -> float:
    """Mean over every rank; TP ranks of one data-parallel rank hold the same loss, so
    this is also the mean over data-parallel ranks."""
    total = loss.detach().clone()
    dist.all_reduce(total)  # SUM
    return total.item() / dist.get_world_size()


def train_against_reference(
    model: nn.Module,
    ref: nn.Module,
    batches: list[Batch],
    local: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Loss,
) -> list[dict]:
    """One AdamW step per global batch, with clipping; ours sees ``local(x)``."""
    opt, ref_opt = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    records = []
    for x, y in batches:
        loss = loss_fn(model(local(x)), local(y))
        loss.backward()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        rec = {
            "loss": (mean_over_world(loss), ref_loss.item()),
            "grads": full_pairs(model, ref, grads=True),
        }
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_MAX_NORM)
        rec["norm"] = (full(norm).item(), ref_norm.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    return records


def assert_pairs_close(pairs: Pairs, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    assert pairs, f"{what}: nothing to compare"
    for name, (ours, ref) in pairs.items():
        torch.testing.assert_close(
            ours, ref, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def assert_train_parity(ranks: list[list[dict]], steps: int) -> None:
    """Every rank, every step: mean loss, clipped norm, full grads and params match."""
    for rank, records in enumerate(ranks):
        assert len(records) == steps
        for step, rec in enumerate(records):
            where = f"rank {rank} step {step}"
            loss, ref_loss = rec["loss"]
            assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL), where
            norm, ref_norm = rec["norm"]
            assert ref_norm > CLIP_MAX_NORM, f"{where}: clipping would not fire"
            assert norm == pytest.approx(ref_norm, rel=RTOL), f"{where} total grad norm"
            assert_pairs_close(rec["grads"], f"{where} grad")
            assert_pairs_close(rec["params"], f"{where} param")
    # The parameters moved: the comparison is not of two untouched copies.
    first, last = ranks[0][0]["params"], ranks[0][-1]["params"]
    assert any(not torch.equal(first[n][0], last[n][0]) for n in first)
