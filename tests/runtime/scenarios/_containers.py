"""Activations inside containers for the autograd scenarios (``test_scenarios_autograd.py``):
a list, tuple, namedtuple, dict, dataclass or nested dataclass carrying two tensors
that need grad next to values that are not (a string, an int, an integer tensor), and a
model whose sharded blocks pass them on."""

import collections
import dataclasses
from typing import Any

import torch
from torch import nn

from tests.runtime.scenarios._blocks import DIM

Pair = collections.namedtuple("Pair", "x y tag n idx")


@dataclasses.dataclass
class Flat:
    x: torch.Tensor
    y: torch.Tensor
    tag: str
    n: int
    idx: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    tag: str


@dataclasses.dataclass
class Outer:
    inner: Inner
    y: torch.Tensor
    n: int
    idx: torch.Tensor


KINDS = ("list", "tuple", "namedtuple", "dict", "dataclass", "nested_dataclass")


def _pack(kind: str, x: torch.Tensor, y: torch.Tensor, n: int) -> Any:
    """(x, y) with a string, an int and an integer tensor (no grad) beside them."""
    idx = x.detach().argmax(dim=-1)
    if kind == "list":
        return [x, y, "tag", n, idx]
    if kind == "tuple":
        return (x, y, "tag", n, idx)
    if kind == "namedtuple":
        return Pair(x, y, "tag", n, idx)
    if kind == "dict":
        return {"x": x, "y": y, "tag": "tag", "n": n, "idx": idx}
    if kind == "dataclass":
        return Flat(x, y, "tag", n, idx)
    return Outer(Inner(x, "tag"), y, n, idx)


def _unpack(kind: str, value: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    if kind in ("list", "tuple", "namedtuple"):
        x, y, tag, n, _ = value
    elif kind == "dict":
        x, y, tag, n = value["x"], value["y"], value["tag"], value["n"]
    elif kind == "dataclass":
        x, y, tag, n = value.x, value.y, value.tag, value.n
    else:
        x, y, tag, n = value.inner.x, value.y, value.inner.tag, value.n
    assert tag == "tag"
    return x, y, n


class ContainerBlock(nn.Module):
    """Unpacks its container, runs a Linear on each tensor, packs them again."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin_x = nn.Linear(DIM, DIM)
        self.lin_y = nn.Linear(DIM, DIM)

    def forward(self, value: Any) -> Any:
        x, y, n = _unpack(self.kind, value)
        return _pack(self.kind, self.lin_x(x).relu(), self.lin_y(y + x).tanh(), n + 1)


class ContainerModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Linear(DIM, DIM)  # the blocks' inputs require grad
        self.blocks = nn.ModuleList(ContainerBlock(kind) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        value = _pack(self.kind, h, h.clone(), 0)
        for block in self.blocks:
            value = block(value)
        out_x, out_y, n = _unpack(self.kind, value)
        assert n == len(self.blocks)
        return (out_x.float() * out_y.float()).sum()
