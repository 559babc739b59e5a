"""Graph mode's collectives: what graph/gather.py issues where the eager runtime calls c10d.

The default strategies (comm_strategies.py) become functional collectives
(``torch.ops._c10d_functional``), which the compiler sees, buckets and reorders. Any
other strategy (a user's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``,
``set_allocate_memory_from_process_group_for_comm``'s, ``set_symm_mem_for_comm``'s) and
the user's all-reduce hook are Python objects that call c10d themselves: each runs
inside an opaque custom op (``dtensor_fsdp::strategy_all_gather`` ...), which the
compiled graph calls as eager calls them, with the same buffers' contents.

[Note: strategy registry] A custom op takes tensors and scalars, not Python objects, so
a strategy (or hook) is passed by name: `op_name` (`hook_name`) files it in
``_REGISTRY`` under a name made of its id when graph mode is enabled, and the op looks
it up when it runs. c10d names its process groups in a global
registry the same way (``_resolve_process_group``). Entries are weak: a strategy lives
as long as its group holds it.
"""

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..runtime.comm_strategies import DefaultAllGather, DefaultReduceScatter

_ops = torch.ops._c10d_functional
_REGISTRY: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def op_name(strategy: Any) -> str | None:
    """The name ``strategy`` runs under in the custom ops (see [Note: strategy
    registry]); None for the defaults, which run as functional collectives. Called
    when graph mode is enabled, outside any traced code."""
    if isinstance(strategy, (DefaultAllGather, DefaultReduceScatter)):
        return None
    name = f"{type(strategy).__qualname__}@{id(strategy):x}"
    _REGISTRY[name] = strategy
    return name


def all_gather(flat: torch.Tensor, name: str | None, world_size: int, group: str) -> torch.Tensor:
    """(W * n,) rank-major: every rank's ``flat`` (n,), by the strategy ``name``
    (`op_name`)."""
    if name is None:
        return _ops.wait_tensor(_ops.all_gather_into_tensor(flat, world_size, group))
    return strategy_all_gather(flat, name, world_size, group)


def reduce_scatter(
    flat: torch.Tensor, name: str | None, op: str, world_size: int, group: str
) -> torch.Tensor:
    """This rank's chunk (n / W,) of ``flat`` reduced with ``op`` ("sum", "avg"), by
    the strategy ``name`` (`op_name`)."""
    if name is None:
        return _ops.wait_tensor(_ops.reduce_scatter_tensor(flat, op, world_size, group))
    return strategy_reduce_scatter(flat, name, op, world_size, group)


def all_to_all(rows: torch.Tensor, group: str) -> torch.Tensor:
    """(W, n) rows: row r sent to rank r, row r of the result received from rank r."""
    world_size = rows.shape[0]
    splits = [rows.shape[1]] * world_size
    flat = rows.reshape(-1)
    received = _ops.wait_tensor(_ops.all_to_all_single(flat, splits, splits, group))
    return received.view(world_size, -1)


def all_reduce(tensor: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(tensor, op, group))


def hook_name(hook: Any) -> str:
    """The name the all-reduce ``hook`` runs under in ``call_hook`` (`op_name`)."""
    name = f"hook@{id(hook):x}"
    _REGISTRY[name] = hook
    return name


# The custom ops #


@torch.library.custom_op("dtensor_fsdp::strategy_all_gather", mutates_args=())
def strategy_all_gather(flat: torch.Tensor, name: str, world_size: int, group: str) -> torch.Tensor:
    strategy = _REGISTRY[name]
    output = strategy.allocate((world_size * flat.numel(),), dtype=flat.dtype, device=flat.device)
    _wait(strategy(output, flat, _resolve_process_group(group), async_op=True))
    return output


@strategy_all_gather.register_fake
def _(flat: torch.Tensor, name: str, world_size: int, group: str) -> torch.Tensor:
    return flat.new_empty(world_size * flat.numel())


@torch.library.custom_op("dtensor_fsdp::strategy_reduce_scatter", mutates_args=())
def strategy_reduce_scatter(
    flat: torch.Tensor, name: str, op: str, world_size: int, group: str
) -> torch.Tensor:
    strategy = _REGISTRY[name]
    output = strategy.allocate((flat.numel() // world_size,), dtype=flat.dtype, device=flat.device)
    reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    _wait(strategy(output, flat, _resolve_process_group(group), reduce_op, async_op=True))
    return output


@strategy_reduce_scatter.register_fake
def _(flat: torch.Tensor, name: str, op: str, world_size: int, group: str) -> torch.Tensor:
    return flat.new_empty(flat.numel() // world_size)


@torch.library.custom_op("dtensor_fsdp::call_hook", mutates_args=("tensor",))
def call_hook(tensor: torch.Tensor, name: str) -> None:
    _REGISTRY[name](tensor)


def _wait(work: dist.Work | None) -> None:
    # A strategy may return no Work (it ran synchronously).
    if work is not None:
        work.wait()
