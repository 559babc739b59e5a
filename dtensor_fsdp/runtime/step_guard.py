"""StepGuard: sees an optimizer step between a group's forward and its backward.

[Note: optimizer step between forward and backward]
A backward whose forward computed with other values of the sharded params mixes the
values before and after the change in its gradients. Plain PyTorch raises ("modified
by an inplace operation") from the version counters autograd saved; torch's FSDP2
computes silently. The group's version check
(`GroupGuards.check_unchanged_since_forward`, group_guards.py) sees every write that
bumps a version counter: a per-tensor ``torch.optim`` step (on the DTensor),
``step_on_local_shards`` and ``copy_`` (on the local tensor). A foreach
or fused ``torch.optim`` step on DTensors (the default on an accelerator) writes the
local tensors below autograd and bumps neither counter; so the guard also watches
every optimizer step, whatever its implementation, through torch's global optimizer
step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``), which
``torch.optim.Optimizer`` runs after each ``step()`` of every subclass (Muon's too).

One guard per root (on its CommContext). A group whose forward completed with grad
enabled awaits its backward (`forward_done`) until its pre-backward (`take`), the end
of the backward or an abandoned iteration (`clear`). The hook is registered at the
first such forward and costs one truth test per optimizer step while no group awaits
a backward (the usual step, after the backward); only then does it read the
optimizer's params and mark the awaiting groups whose sharded params it holds and
could have changed, which the group raises at its pre-backward.

Only a param with a gradient can have changed: ``torch.optim`` skips a param whose
``.grad`` is None (every optimizer, per-tensor, foreach and fused alike), and so does
plain PyTorch's version check, which sees no write. One optimizer over two models'
param groups (a GAN's generator and discriminator) that steps for one model while the
other's forward awaits its backward, whose grads are None then, is plain PyTorch's and
torch's FSDP2's usual loop, and must not trip the guard.
"""

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .param import FSDPParam


@dataclass(frozen=True)
class StepSeen:
    """An optimizer step that changed a group's sharded params before its backward."""

    optimizer: str  # its class name
    names: list[str]  # the FQNs of the group's params it holds


class StepGuard:
    """One root's groups awaiting their backward, and the optimizer hook that marks them."""

    def __init__(self) -> None:
        # Per awaiting group (by id): its params, read only when an optimizer steps.
        self._awaiting: dict[int, list[FSDPParam]] = {}
        self._seen: dict[int, StepSeen] = {}  # the awaiting groups an optimizer stepped
        self._handle: RemovableHandle | None = None

    def forward_done(self, group: object, params: list[FSDPParam]) -> None:
        """``group``'s forward completed with grad enabled: its backward may follow.
        Forgets a step seen before this forward (it computed with the new values)."""
        if self._handle is None:
            self._register()
        key = id(group)
        self._awaiting[key] = params
        if self._seen:
            self._seen.pop(key, None)

    def take(self, group: object) -> StepSeen | None:
        """``group``'s backward starts: the step seen since its forward, if any."""
        key = id(group)
        if self._awaiting.pop(key, None) is None:
            return None
        return self._seen.pop(key, None)

    def clear(self) -> None:
        """The backward ended, or the iteration was abandoned: nothing awaits."""
        if self._awaiting:
            self._awaiting.clear()
            self._seen.clear()

    def step_done(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` stepped: mark the awaiting groups whose params it holds with a
        gradient (it skipped the others: they did not change)."""
        if not self._awaiting:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for key, params in self._awaiting.items():
            names = [
                p.fqn
                for p in params
                if id(p.sharded_param) in held and p.sharded_param.grad is not None
            ]
            if names:
                self._seen[key] = StepSeen(type(optimizer).__qualname__, names)

    def _register(self) -> None:
        # The global registry must not keep the root alive: the hook holds the guard
        # weakly, and the handle is removed when the guard is collected.
        guard = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            live = guard()
            if live is not None:
                live.step_done(optimizer)

        self._handle = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, self._handle.remove)
