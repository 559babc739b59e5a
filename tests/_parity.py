"""Shared by the N-D mesh parity tests (``test_hsdp.py``, ``test_tp.py``).

Child side: ``train_against_reference`` trains a sharded model on this rank's slice and
a single-process copy on the global batch in lockstep, recording per step the losses,
the clipped total grad norms, and ``full_tensor()`` grads and params next to the
reference's; ``local_pairs`` records this rank's local shards (or grads) next to torch's
``fully_shard``'s. Parent side: ``assert_pairs_close``, ``assert_params_close``,
``assert_pairs_equal`` and ``assert_train_parity``.

[Note: parity tolerances]
Which comparison gets which tolerance, and why:

1. Against torch's ``fully_shard`` (local shards, local grads, losses): bitwise
   (``assert_pairs_equal``) wherever both run the same arithmetic: the same local
   matmuls on the same shards, the same reductions, the same optimizer on the same
   local tensors. This is the tight check of the whole step. It holds where each
   reduction adds two ranks' terms (a + b == b + a exactly); over 3 or more ranks
   gloo's reduce-scatter (torch) and ours sum in another order, and items 2-3 apply.
2. Against a single-process model on the global batch, losses and gradients: the same
   fp32 terms summed in another order (each rank's matmul over its micro-batch, then a
   reduce-scatter, vs one matmul over the global batch), so they agree to a few ulps
   (2^-24 ~ 6e-8 relative) of the largest summed terms; observed <= 2e-7 absolute on
   the test models. ``ATOL = RTOL = 1e-5`` leaves margin for other CPUs' kernels (fp32
   results of one program differ in the last bits between AMD's and Intel's kernels).
3. Against the single-process model, parameters after AdamW steps: Adam amplifies
   those rounding differences without bound in relative terms. Its per-element update
   is ``lr * m_hat / (sqrt(v_hat) + eps)``; where a gradient component is near ``eps``
   (1e-8; clipped gradients of these models reach it), the update's sensitivity to the
   gradient is ``lr * eps / (|g| + eps)**2``, up to ``lr / eps`` = 1e6: a 1e-11 rounding
   difference in such a gradient moves the parameter by 1e-5 (observed: 1.41e-5 on one
   AMD EPYC, 1.04e-5 on another, with torch's ``fully_shard`` and ours alike). What is
   bounded is the update itself: by Cauchy-Schwarz ``|m_hat / sqrt(v_hat)| <=
   sqrt(sum_i a_i**2 / b_i)`` for the bias-corrected EMA weights a_i (beta1) and b_i
   (beta2), which is <= 1.05 for the first 10 steps (``ADAM_UPDATE_BOUND``). So two runs
   whose gradients differ only by rounding can end ``2 * 1.05 * lr`` apart per step in
   such an element (``adamw_param_atol``), whatever the gradient scale; weight decay
   adds ``lr * weight_decay * |difference|``, negligible. This bound is loose for
   most elements, so the parameter comparison against the single-process model only
   catches gross errors: the tight checks of an optimizer step are the next step's
   loss and gradients (item 2) and the bitwise comparison with torch (item 1).
   SGD's update is linear in the gradient, so SGD parameters keep ``ATOL``/``RTOL``.

Records hold plain tensors and floats only, so they pickle back to the parent.
"""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ATOL = RTOL = 1e-5  # losses and gradients against a single process: item 2 of the Note
LR = 1e-2
WEIGHT_DECAY = 0.1
# Bound on Adam's normalized update |m_hat / (sqrt(v_hat) + eps)| for the first 10 steps
# with torch's default betas (0.9, 0.999): item 3 of the Note.
ADAM_UPDATE_BOUND = 1.05
ADAM_BOUND_MAX_STEPS = 10
CLIP_MAX_NORM = 0.05  # below the test models' gradient norms, so clipping always fires

# A pair is (ours, reference) for one parameter FQN.
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
Batch = tuple[torch.Tensor, torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def adamw_param_atol(steps: int, lr: float = LR) -> float:
    """How far apart AdamW can move a parameter element in ``steps`` steps from the same
    start when the two runs' gradients differ only by fp32 rounding (see [Note: parity
    tolerances], item 3)."""
    assert 1 <= steps <= ADAM_BOUND_MAX_STEPS, (
        f"ADAM_UPDATE_BOUND holds for <= 10 steps, not {steps}"
    )
    return 2 * ADAM_UPDATE_BOUND * lr * steps


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full params and optimizer state (e.g. AdamW's exp_avg, exp_avg_sq, step) per FQN,
    as ``name`` and ``name/key``."""
    state = {}
    for name, p in model.named_parameters():
        state[name] = full(p)
        for key, value in optimizer.state[p].items():
            state[f"{name}/{key}"] = full(value)
    return state


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


def local_trainable_grad_pairs(ours: nn.Module, theirs: nn.Module) -> Pairs:
    """Per trainable FQN, this rank's local grad of ours and of torch's (frozen params,
    e.g. a LoRA base or NF4 weights, have none)."""
    their_params = dict(theirs.named_parameters())
    return {
        name: (p.grad.to_local().clone(), their_params[name].grad.to_local().clone())
        for name, p in ours.named_parameters()
        if p.requires_grad
    }


def step_against_torch(
    ours: nn.Module,
    theirs: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    losses: list[torch.Tensor],
) -> dict:
    """Backward both losses, record both losses and the local grads side by side, step
    every optimizer, then record the local shards side by side."""
    for loss in losses:
        loss.backward()
    record = {
        "loss": tuple(loss.item() for loss in losses),
        "grads": local_pairs(ours, theirs, grads=True),
    }
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    record["params"] = local_pairs(ours, theirs, grads=False)
    return record


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


def assert_params_close(pairs: Pairs, what: str, steps: int, lr: float = LR) -> None:
    """Parameters after ``steps`` AdamW steps against a single-process reference."""
    assert_pairs_close(pairs, what, atol=adamw_param_atol(steps, lr), rtol=RTOL)


def assert_pairs_equal(pairs: Pairs, what: str) -> None:
    """Bitwise: for comparisons with torch's ``fully_shard`` where the arithmetic is the
    same (see [Note: parity tolerances], item 1)."""
    assert pairs, f"{what}: nothing to compare"
    for name, (ours, ref) in pairs.items():
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
            f"{what} {name}: {ours.dtype}{tuple(ours.shape)} vs {ref.dtype}{tuple(ref.shape)}"
        )
        if not torch.equal(ours, ref):
            diff = (ours.double() - ref.double()).abs().max().item()
            raise AssertionError(f"{what} {name}: not bitwise equal (max abs diff {diff:.3g})")


def assert_train_parity(ranks: list[list[dict]], steps: int) -> None:
    """Every rank, every step: mean loss, clipped norm, full grads and params match
    (AdamW from ``make_optimizer``; see [Note: parity tolerances])."""
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
            assert_params_close(rec["params"], f"{where} param", steps=step + 1)
    # The parameters moved: the comparison is not of two untouched copies.
    first, last = ranks[0][0]["params"], ranks[0][-1]["params"]
    assert any(not torch.equal(first[n][0], last[n][0]) for n in first)
