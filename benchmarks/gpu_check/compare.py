"""How two training records are compared, and with which tolerance.

The tolerances are those of ``tests/_parity.py`` ([Note: parity tolerances]):

1. Ours against torch's ``fully_shard`` on the same setting: bitwise wherever both run
   the same arithmetic: the same local kernels on the same shards, the same reductions
   (each adds two ranks' terms, and a + b == b + a exactly), the same optimizer.
2. Where a reduction adds more than two ranks' terms (W=4 without HSDP), gloo's
   reduce-scatter (torch's) and ours' all-to-all plus a local sum add them in another
   order: losses and step-1 gradients agree to rounding, ``ATOL = RTOL = 1e-5``.
3. Against the plain model on the global batch: step-1 losses and gradients as in 2
   (the same terms summed in another order); parameters after the AdamW steps within
   ``adamw_param_atol``: Adam amplifies rounding differences without bound in relative
   terms, but each step's update is bounded (``|m_hat / sqrt(v_hat)| <= 1.05`` for the
   first 10 steps), so two runs whose gradients differ only by rounding end at most
   ``2 * 1.05 * lr`` apart per step.
"""

import torch
import torch.distributed as dist

from gpu_check.report import Check
from gpu_check.training import LR, Rank, Record, local_part

ATOL = RTOL = 1e-5  # item 2 (and 3's losses and step-1 gradients)
ADAM_UPDATE_BOUND = 1.05  # |m_hat / (sqrt(v_hat) + eps)| in the first 10 steps (item 3)


def adamw_param_atol(steps: int) -> float:
    assert steps <= 10, "ADAM_UPDATE_BOUND holds for the first 10 steps"
    return 2 * ADAM_UPDATE_BOUND * LR * steps


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    if a.keys() != b.keys():
        return f"names differ: {sorted(a.keys() ^ b.keys())[:3]}"
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if not torch.equal(x, y):
            return f"{name}: max |diff| {_max_diff(x, y):.3g}"
    return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare_bitwise(name: str, a: Record, b: Record) -> Check:
    """Item 1: every step's loss, step 1's and the last step's local grads, and the
    final local params, bit for bit."""
    where = None
    if a.losses != b.losses:
        step = next(i for i, (x, y) in enumerate(zip(a.losses, b.losses)) if x != y)
        where = f"loss at step {step + 1}: {a.losses[step]!r} vs {b.losses[step]!r}"
    for what, x, y in (
        ("step-1 grad", a.first_grads, b.first_grads),
        ("last grad", a.last_grads, b.last_grads),
        ("param", a.params, b.params),
    ):
        difference = _first_difference(x, y)
        if where is None and difference is not None:
            where = f"{what} {difference}"
    steps = len(a.losses)
    detail = where or f"bitwise ({steps} losses, grads of steps 1 and {steps}, params)"
    return Check(name, where is None, detail)


def compare_close(name: str, a: Record, b: Record) -> Check:
    """Item 2: ``a`` against ``b`` where their reductions add terms in another order."""
    exact = compare_bitwise(name, a, b)
    if exact.ok:
        return exact
    return _within_rounding(
        name, a.losses, b.losses, a.first_grads, b.first_grads, a.params, b.params
    )


def compare_with_plain(name: str, fsdp: Record, plain: Record, rank: Rank) -> Check:
    """Item 3: the FSDP run (losses averaged over ranks) against the plain model on the
    global batch, on this rank's shards. Every rank must call it (one all-reduce)."""
    local = torch.tensor(fsdp.losses, dtype=torch.float64, device=rank.device)
    dist.all_reduce(local)  # each rank's loss is the mean over its rows; the rows are equal
    mean = local.div_(rank.dp_size).tolist()
    grads = {n: local_part(g, fsdp.chunking[n]) for n, g in plain.first_grads.items()}
    params = {n: local_part(p, fsdp.chunking[n]) for n, p in plain.params.items()}
    return _within_rounding(name, mean, plain.losses, fsdp.first_grads, grads, fsdp.params, params)


def _within_rounding(
    name: str, losses: list[float], reference_losses: list[float],
    grads: dict[str, torch.Tensor], reference_grads: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor], reference_params: dict[str, torch.Tensor],
) -> Check:  # fmt: skip
    """Step 1's loss and grads allclose (items 2 and 3: the same terms summed in another
    order, from the same parameters), the final params within the AdamW bound; the
    later losses are reported (they follow parameters that rounding moved apart)."""
    first = abs(losses[0] - reference_losses[0])
    loss_ok = first <= ATOL + RTOL * abs(reference_losses[0])
    grads_ok = all(
        torch.allclose(grads[n].double(), reference_grads[n].double(), rtol=RTOL, atol=ATOL)
        for n in grads
    )
    grad_diff = max(_max_diff(grads[n], reference_grads[n]) for n in grads)
    param_diff = max(_max_diff(params[n], reference_params[n]) for n in params)
    atol = adamw_param_atol(len(losses))
    later = max(abs(x - y) for x, y in zip(losses, reference_losses))
    detail = (
        f"step-1 loss and grads allclose(rtol={RTOL:g}, atol={ATOL:g}) (max |diff| "
        f"{max(first, grad_diff):.2g}), params {param_diff:.2g} <= {atol:g} (AdamW bound); "
        f"max |loss diff| over {len(losses)} steps {later:.2g}"
    )
    return Check(name, loss_ok and grads_ok and param_diff <= atol, detail)
