"""Optimizer configurations shared by the local-shard step tests (unit and dist).

Each case builds an optimizer (and optionally an LR scheduler) from a model's
``named_parameters()``, so the same configuration is built for torch's ``fully_shard``,
ours and a single-process reference. ``Lion`` is a user-written element-wise optimizer
(not in torch), stepped with ``elementwise=True``.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

Named = Iterable[tuple[str, nn.Parameter]]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): element-wise, sign of an interpolated momentum."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def decay_groups(named: Named, weight_decay: float) -> list[dict]:
    """Weight decay for matrices, none for norms (1-D), as torchtitan and nanoGPT do."""
    named = list(named)
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


@dataclass(frozen=True)
class Case:
    """An optimizer configuration; ``build(named) -> (optimizer, scheduler or None)``."""

    build: Callable[[Named], tuple[torch.optim.Optimizer, object | None]]
    elementwise: bool = False  # for step_on_local_shards: a user class


def _plain(cls: type, **kwargs) -> Callable[[Named], tuple[torch.optim.Optimizer, None]]:
    return lambda named: (cls([p for _, p in named], **kwargs), None)


def _adamw_groups_scheduler(named: Named):
    optimizer = torch.optim.AdamW(decay_groups(named, 0.1), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


CASES: dict[str, Case] = {
    "adamw_groups_steplr": Case(_adamw_groups_scheduler),
    "adamw_foreach": Case(_plain(torch.optim.AdamW, lr=1e-2, foreach=True)),
    "adamw_fused": Case(_plain(torch.optim.AdamW, lr=1e-2, fused=True)),
    "adam_amsgrad_maximize": Case(
        _plain(torch.optim.Adam, lr=1e-3, amsgrad=True, maximize=True, weight_decay=0.01)
    ),
    "sgd_nesterov": Case(
        _plain(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    ),
    "sgd_foreach": Case(_plain(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=True)),
    "adagrad": Case(
        _plain(torch.optim.Adagrad, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)
    ),
    "rmsprop_centered": Case(_plain(torch.optim.RMSprop, lr=1e-3, momentum=0.9, centered=True)),
    "adadelta": Case(_plain(torch.optim.Adadelta, lr=1.0)),
    "adamax": Case(_plain(torch.optim.Adamax, lr=1e-2)),
    "asgd": Case(_plain(torch.optim.ASGD, lr=1e-2, t0=2)),
    "nadam": Case(
        _plain(torch.optim.NAdam, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01)
    ),
    "radam": Case(_plain(torch.optim.RAdam, lr=1e-2)),
    "rprop": Case(_plain(torch.optim.Rprop, lr=1e-2)),
    "lion": Case(_plain(Lion, lr=1e-3, weight_decay=0.1), elementwise=True),
}
