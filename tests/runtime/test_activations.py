"""Which tensors of a forward's inputs and outputs FSDP sees (runtime/activations.py),
against torch FSDP2's own traversal (``collect_grad_tensors``, ``replace_grad_tensors``):
the same tensors in the same order, in tuples, lists, dicts, named tuples, dataclasses
(frozen, nested) and Hugging Face's ``ModelOutput``; containers rebuilt only when a
tensor in them changed. In one process, no group.
"""

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
from torch.distributed.fsdp._common_utils import collect_grad_tensors
from torch.distributed.fsdp._common_utils import replace_grad_tensors as torch_replace

from dtensor_fsdp.runtime.activations import (
    grad_tensors,
    iter_tensors,
    map_tensors,
    replace_grad_tensors,
)


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    aux: dict
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor
    extra: tuple


@dataclasses.dataclass
class NoInit:
    value: torch.Tensor
    derived: torch.Tensor = dataclasses.field(init=False)


def _leaf(n: int, grad: bool = True) -> torch.Tensor:
    return torch.full((2,), float(n), requires_grad=grad)


def _trees() -> dict[str, object]:
    return {
        "tuple": (_leaf(0), [_leaf(1), _leaf(2, grad=False)], {"k": _leaf(3)}),
        "namedtuple": Pair(_leaf(0), (_leaf(1), 5)),
        "dataclass": Output(_leaf(0), {"a": _leaf(1), "b": [_leaf(2)]}),
        "frozen": Frozen(_leaf(0), (_leaf(1, grad=False), _leaf(2))),
        "ordered": OrderedDict(b=_leaf(0), a=Output(_leaf(1), {})),
        "nested": [Frozen(_leaf(0), (Pair(_leaf(1), None),)), {"x": (_leaf(2),)}],
        "none": (None, 3, "s", {1, 2}),
    }


@pytest.mark.parametrize("name", list(_trees()))
def test_the_same_tensors_as_torch_in_the_same_order(name: str) -> None:
    tree = _trees()[name]
    ours, theirs = grad_tensors(tree), collect_grad_tensors(tree)
    assert [id(t) for t in ours] == [id(t) for t in theirs]


@pytest.mark.parametrize("name", list(_trees()))
def test_replacing_gives_torchs_structure_and_values(name: str) -> None:
    tree = _trees()[name]
    count = len(grad_tensors(tree))
    ours = replace_grad_tensors(tree, [torch.full((2,), 10.0 + i) for i in range(count)])
    theirs = torch_replace(tree, iter([torch.full((2,), 10.0 + i) for i in range(count)]))
    assert type(ours) is type(theirs)
    assert [t.tolist() for t in iter_tensors(ours)] == [t.tolist() for t in iter_tensors(theirs)]


def test_hugging_face_model_output_is_traversed() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.CausalLMOutputWithPast(loss=_leaf(0), logits=_leaf(1))
    assert [id(t) for t in grad_tensors(out)] == [id(out.loss), id(out.logits)]
    cast = map_tensors(lambda t: t.to(torch.bfloat16), out)
    assert type(cast) is type(out)
    assert cast["logits"].dtype == torch.bfloat16 and cast.logits.dtype == torch.bfloat16


def test_containers_without_changes_come_back_as_they_were() -> None:
    tree = _trees()["nested"]
    assert map_tensors(lambda t: t, tree) is tree
    changed = map_tensors(lambda t: t * 2, tree)
    assert changed is not tree and changed[1] is not tree[1]


def test_a_tensor_in_an_init_false_field_names_the_field() -> None:
    value = NoInit(_leaf(0))
    value.derived = _leaf(1)
    with pytest.raises(TypeError, match="field 'derived' of NoInit"):
        map_tensors(lambda t: t * 2, value)
