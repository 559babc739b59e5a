"""Shared by the bad-input tests: a module's snapshot, and a call that must raise
and leave the module untouched."""

from collections.abc import Callable
from typing import Any

import pytest
import torch.nn as nn


def _snapshot(model: nn.Module) -> list[tuple[Any, ...]]:
    """Everything fully_shard could mutate: classes, parameter objects, hooks, state."""
    return [
        (
            name,
            type(m),
            tuple((n, id(p)) for n, p in m._parameters.items()),
            tuple((n, id(b)) for n, b in m._buffers.items()),
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            sorted(m.__dict__),
        )
        for name, m in model.named_modules()
    ]


def _assert_rejected(model: nn.Module, call: Callable[[], Any], error: type, match: str) -> None:
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        call()
    assert _snapshot(model) == before


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))

