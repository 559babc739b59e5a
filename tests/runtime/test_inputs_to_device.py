"""The root moves its forward inputs to the mesh's device, as torch's FSDP2 and DDP do
with ``torch.distributed.utils._to_kwargs``. On CPU machines the move is a no-op, so the
comparison moves to the ``meta`` device, which every structure and tensor supports."""

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch.distributed.utils import _to_kwargs

from dtensor_fsdp.runtime.state import inputs_to_device

META = torch.device("meta")
Pair = namedtuple("Pair", ["a", "b"])


@dataclass
class Batch:
    tokens: torch.Tensor
    mask: torch.Tensor | None
    name: str = "batch"


def _describe(tree: object) -> object:
    """The structure with each tensor replaced by (device, dtype, shape)."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", tree.device.type, tree.dtype, tuple(tree.shape))
    if isinstance(tree, Batch):
        return ("Batch", _describe(tree.tokens), _describe(tree.mask), tree.name)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return (type(tree).__name__, *(_describe(x) for x in tree))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, *(_describe(x) for x in tree))
    if isinstance(tree, dict):
        return ("dict", *((k, _describe(v)) for k, v in tree.items()))
    return tree


def test_nested_inputs_move_like_torchs() -> None:
    args = (
        torch.ones(2, 3),
        [torch.zeros(4, dtype=torch.int64), 7],
        Pair(torch.ones(1), "x"),
        Batch(torch.arange(5), None),
    )
    kwargs = {"mask": torch.ones(2, dtype=torch.bool), "n": 3, "nested": {"t": torch.ones(1)}}
    ours_args, ours_kwargs = inputs_to_device((args, kwargs), META)
    torch_args, torch_kwargs = _to_kwargs(args, kwargs, META, False)
    assert _describe(ours_args[:3]) == _describe(torch_args[0][:3])
    assert _describe(ours_kwargs) == _describe(torch_kwargs[0])
    assert _describe(ours_args)[1] == ("tensor", "meta", torch.float32, (2, 3))
    # A dataclass batch: torch 2.13 leaves its tensors where they are (the forward then
    # fails on the device); ours moves them too (README, differences from torch).
    assert _describe(torch_args[0][3])[1][1] == "cpu"
    assert _describe(ours_args[3]) == (
        "Batch",
        ("tensor", "meta", torch.int64, (5,)),
        None,
        "batch",
    )


def test_tensors_already_on_the_device_are_passed_through() -> None:
    tensor = torch.ones(2, device=META)
    (moved,), _ = inputs_to_device(((tensor,), {}), META)
    assert moved is tensor
