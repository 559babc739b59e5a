"""The tensors inside a module's forward inputs and outputs.

FSDP hooks every tensor that needs a gradient in a module's inputs (the post-backward
node) and outputs (the pre-backward hook), moves the root's inputs to the device and
casts inputs and outputs for mixed precision. Activations come nested: tuples, lists,
dicts, named tuples and dataclasses (Hugging Face's ``ModelOutput`` is both a dict and a
dataclass). A tensor these functions cannot see gets no hook: with
``reshard_after_forward=True`` its backward reads freed storage, otherwise its module's
parameters silently get no gradient. torch's FSDP2 traverses the same containers
(``collect_grad_tensors``, ``_apply_to_tensors``), in the same order: named tuples,
dataclasses, dicts, then lists and tuples; sets and other iterables are left alone.
"""

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``tree``, in the order `map_tensors` visits them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif _is_namedtuple(tree):
        for item in tree:
            yield from iter_tensors(item)
    elif _is_dataclass_instance(tree):
        for field in dataclasses.fields(tree):
            yield from iter_tensors(getattr(tree, field.name))
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from iter_tensors(item)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``, visiting containers in
    `iter_tensors`' order. A container is rebuilt (same type; a dataclass through
    ``dataclasses.replace``) only if a tensor in it was replaced."""
    return _map(fn, tree)[0]


def _map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> tuple[Any, bool]:
    """``(mapped tree, whether any tensor in it was replaced)``. Whether something
    changed is carried up rather than found by comparing containers by identity:
    dynamo traces ``is`` between tensors but not between tuples (graph mode casts its
    inputs through this function)."""
    if isinstance(tree, torch.Tensor):
        new = fn(tree)
        return new, new is not tree
    if _is_namedtuple(tree):
        items, changed = _map_items(fn, tree)
        return (type(tree)(*items) if changed else tree), changed
    if _is_dataclass_instance(tree):
        return _map_dataclass(fn, tree)
    if isinstance(tree, dict):
        values, changed = _map_items(fn, tree.values())
        if not changed:
            return tree, False
        rebuilt = type(tree)()  # dict subclasses (OrderedDict) keep their type
        rebuilt.update(zip(tree.keys(), values))
        return rebuilt, True
    if isinstance(tree, (list, tuple)):
        items, changed = _map_items(fn, tree)
        return (type(tree)(items) if changed else tree), changed
    return tree, False


def _map_items(fn: Callable[[torch.Tensor], torch.Tensor], items: Any) -> tuple[list[Any], bool]:
    mapped = [_map(fn, item) for item in items]
    return [value for value, _ in mapped], any(changed for _, changed in mapped)


def _map_dataclass(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> tuple[Any, bool]:
    changes = {}
    for field in dataclasses.fields(tree):
        new, changed = _map(fn, getattr(tree, field.name))
        if not changed:
            continue
        if not field.init:
            raise TypeError(
                f"FSDP cannot hook the tensor in field {field.name!r} of "
                f"{type(tree).__qualname__}: the field has init=False, so "
                "dataclasses.replace cannot set it; make it an init field"
            )
        changes[field.name] = new
    return (dataclasses.replace(tree, **changes), True) if changes else (tree, False)


def grad_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` that need a gradient, in traversal order."""
    return [t for t in iter_tensors(tree) if t.requires_grad]


def replace_grad_tensors(tree: Any, replacements: list[torch.Tensor]) -> Any:
    """``tree`` with its gradient-needing tensors replaced, in `grad_tensors`' order."""
    remaining = iter(replacements)
    result = map_tensors(lambda t: next(remaining) if t.requires_grad else t, tree)
    assert next(remaining, None) is None, "more replacements than tensors needing grad"
    return result
