"""The marks torch's ``fully_shard`` leaves on the modules it manages, which other code
reads: Hugging Face's ``generate()`` turns on ``synced_gpus`` for a model with
``_is_fsdp_managed_module`` (``transformers.distributed.fsdp.is_fsdp_managed_module``),
and dynamo (``torch/_dynamo/variables/builder.py``) reads it and
``_fsdp_use_orig_params``. Ours must set both on exactly the modules torch's does, and
only once validation passed.
"""

from collections.abc import Callable

import pytest
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from tests._harness import fake_mesh

MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4)) for _ in range(2)
        )
        self.frozen = nn.Linear(4, 4)  # ignored in some layouts
        self.act = nn.GELU()  # no parameters, no buffers
        self.stats = nn.BatchNorm1d(4)  # buffers
        self.head = nn.Linear(4, 8)


def _nested(model: Net, shard: Callable, mesh) -> None:
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)


def _ignored(model: Net, shard: Callable, mesh) -> None:
    shard(model.blocks[0], mesh=mesh, ignored_params=set())  # torch: drops the ReLU
    shard(model, mesh=mesh, ignored_params={model.frozen.weight, model.frozen.bias})


def _list_group(model: Net, shard: Callable, mesh) -> None:
    shard([model.blocks[1], model.head], mesh=mesh)


def _marks(model: nn.Module) -> dict[str, tuple[object, ...]]:
    return {
        name: tuple(getattr(m, mark, None) for mark in MARKS) for name, m in model.named_modules()
    }


# Unmarked modules per layout, as torch leaves them: with ignored_params (even empty),
# torch leaves out modules with nothing left to manage, parameterless leaves included.
UNMARKED = {
    _nested: [],
    _ignored: ["act", "blocks.0.1", "blocks.1.1", "frozen"],
    _list_group: ["", "act", "blocks", "blocks.0", "blocks.0.0", "blocks.0.1", "blocks.0.2",
                  "embed", "frozen", "stats"],
}


@pytest.mark.parametrize("layout", list(UNMARKED), ids=lambda f: f.__name__)
def test_marks_the_modules_torch_marks(layout: Callable) -> None:
    with fake_mesh(2) as mesh:
        marks = {}
        for impl, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
            model = Net()
            layout(model, shard, mesh)
            marks[impl] = _marks(model)
    assert marks["ours"] == marks["torch"]
    assert sorted(n for n, v in marks["ours"].items() if v == (None, None)) == UNMARKED[layout]
    assert {v for v in marks["ours"].values()} <= {(True, True), (None, None)}


def test_a_failed_fully_shard_leaves_no_mark() -> None:
    with fake_mesh(2) as mesh:
        model = Net()
        with pytest.raises(TypeError, match="reshard_after_forward"):
            fully_shard(model, mesh=mesh, reshard_after_forward="yes")
    assert set(_marks(model).values()) == {(None, None)}
