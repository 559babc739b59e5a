"""GroupGuards: a group's version and step guards, called at its lifecycle points.

Two refusals keep a group from computing with values the user already changed, each
cheaper than torch's FSDP2 silence is wrong:

- a stale reshard: a group kept unsharded since an earlier forward or backward whose
  sharded params changed since their all-gather reshards at its next pre-forward, so
  that the forward all-gathers the new values (`is_stale`);
- a backward whose forward computed with other values of the sharded params (an
  ``optimizer.step()`` between forward and backward) raises at its pre-backward, as
  plain PyTorch does (`check_unchanged_since_forward`): from the version counters read
  at the all-gathers, and from the root's `StepGuard` (step_guard.py) for the optimizer
  steps that bump no counter. See [Note: optimizer step between forward and backward]
  (step_guard.py).

The group (param_group.py) calls `gathered` at each all-gather from the sharded params,
`is_stale` at a pre-forward that finds it unsharded, `forward_done` at the end of its
forward and `check_unchanged_since_forward` at its pre-backward; the rest of its verbs
know nothing of versions. Before lazy init there is no step guard (nothing to watch).
"""

import torch

from .param import FSDPParam
from .step_guard import StepGuard

Versions = list[tuple[int, int]]


class GroupGuards:
    """One group's version records and its hand-off to the root's step guard."""

    def __init__(self, fsdp_params: list[FSDPParam]) -> None:
        # The group's own list (sorted in place when its sharded buffer is re-derived).
        self.fsdp_params = fsdp_params
        self.step_guard: StepGuard | None = None  # the root's, handed down at lazy init
        # Each param's `sharded_version` when the unsharded params (or hpZ's post-forward
        # buffer) were last all-gathered from the sharded ones; see `is_stale`.
        self._gathered: Versions | None = None
        # `_gathered` as the forward's autograd graph saw them, from the end of the
        # forward to the pre-backward: see `check_unchanged_since_forward`.
        self._forward: Versions | None = None

    def gathered(self) -> None:
        """The params are all-gathered from the sharded params now. Every group: besides
        the root and reshard_after_forward/backward=False, an explicit unshard() and
        hpZ's post-forward buffer also keep a group's all-gathered values into a forward."""
        self._gathered = [p.sharded_version() for p in self.fsdp_params]

    def is_stale(self) -> bool:
        """Whether the unsharded params (or hpZ's post-forward buffer) no longer hold the
        sharded params' values: an in-place write that bumped a version counter (a
        per-tensor ``torch.optim`` step, ``step_on_local_shards``, ``copy_``),
        ``param.data = ...``, or a param replaced in the module.

        Not seen, as in torch: a foreach or fused ``torch.optim`` step (the default for
        DTensors on an accelerator) writes the local shards below autograd, where no
        version counter counts; after such a step between a ``no_grad`` forward and the
        next forward, call ``model.reshard()`` (README, differences). Resharding at
        every training forward after an evaluation instead would cost one all-gather
        of the root per evaluation loop, which torch does not issue.
        """
        params = self.fsdp_params
        return any(p.is_foreign() or not p.is_current() for p in params) or (
            self._gathered != [p.sharded_version() for p in params]
        )

    def forward_done(self, in_backward: bool) -> None:
        """The group's forward is over. A backward may follow (not after a no_grad
        forward, nor a forward recomputed inside a backward): the step guard watches
        the optimizer steps until it starts."""
        self._forward = self._gathered
        if self.step_guard is not None and not in_backward and torch.is_grad_enabled():
            self.step_guard.forward_done(self, self.fsdp_params)

    def check_unchanged_since_forward(self, fqn: str) -> None:
        """Refuse a backward of group ``fqn`` whose forward computed with other values
        of the sharded params (``optimizer.step()`` between forward and backward).

        Free in the usual case: the versions were read at the forward's all-gather and
        at this backward's (or its prefetch); only a group not gathered again (kept
        unsharded, hpZ, ``set_unshard_in_backward(False)``) reads them now. A foreach
        or fused ``torch.optim`` step bumps no version counter: the step guard saw it.

        Raises:
            RuntimeError: plain PyTorch's "modified by an inplace operation", naming
                the params that changed.
        """
        forward, self._forward = self._forward, None
        seen = self.step_guard.take(self) if self.step_guard is not None else None
        if seen is not None:
            raise RuntimeError(
                _modified_message(fqn, seen.names, f"{seen.optimizer}.step() ran")
            )
        if forward is None:
            return
        now = self._gathered
        if now is forward:
            now = [p.sharded_version() for p in self.fsdp_params]
        if now == forward:
            return
        changed = [p.fqn for p, a, b in zip(self.fsdp_params, forward, now, strict=True) if a != b]
        cause = "an optimizer.step() or another in-place update before loss.backward()?"
        raise RuntimeError(_modified_message(fqn, changed, cause))


def _modified_message(fqn: str, names: list[str], cause: str) -> str:
    """Plain PyTorch's error for a backward after an in-place change of ``names``."""
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: the sharded parameters {names} of '{fqn or 'root'}' changed "
        f"between its forward and this backward ({cause}). Their gradients would mix the "
        "values before and after the change: call backward before updating the parameters"
    )
