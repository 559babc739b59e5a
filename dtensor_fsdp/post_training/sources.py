"""The tensors a weight stream gathers (`Source`): every state-dict entry of a model,
once per tensor (a tied parameter under all its names), in the order the stream takes
them: FSDP group by group, then what no group holds.

Read from the FSDP parameters themselves (their slots), not from ``state_dict()``,
whose pre-hook reshards a group that is unsharded (a root after an evaluation, the
groups `keep_unsharded` holds): streaming leaves the groups as they are.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.state import states_under


@dataclass(frozen=True)
class Source:
    """One tensor to gather and the state-dict names it goes by."""

    names: tuple[str, ...]  # several for a tied parameter, in state-dict order
    value: torch.Tensor  # the sharded param (DTensor), or the module's param or buffer
    fsdp_param: FSDPParam | None = None  # None: not managed by dtensor_fsdp
    group: FSDPParamGroup | None = None

    @property
    def full_shape(self) -> torch.Size:
        return self.value.shape  # a DTensor's global shape

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype


def fsdp_groups(model: nn.Module) -> list[FSDPParamGroup]:
    """Every dtensor_fsdp group under ``model`` (itself included), each once, in the
    order of the ``fully_shard`` calls' modules in ``model.modules()`` (pre-order)."""
    return [group for state in states_under((model,)) for group in state.groups]


def collect_sources(model: nn.Module) -> list[Source]:
    """``model``'s weights: its state-dict entries (parameters and persistent buffers,
    under every path a shared module is reachable by), one `Source` per tensor.

    Raises:
        ValueError: a weight is on the meta device (nothing to stream), naming it.
    """
    prefixes: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), []).append(f"{name}." if name else "")
    sources, held = [], set()
    for group in fsdp_groups(model):
        for fsdp_param in group.fsdp_params:
            names = tuple(
                prefix + slot.name
                for slot in fsdp_param.slots
                for prefix in prefixes.get(id(slot.module), ())
            )
            held.update((id(slot.module), slot.name) for slot in fsdp_param.slots)
            if names:
                sources.append(Source(names, fsdp_param.sharded_param, fsdp_param, group))
    by_tensor: dict[int, list[str]] = {}
    values: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for key, value in _plain_entries(module):
            if value is None or (id(module), key) in held:
                continue
            by_tensor.setdefault(id(value), []).append(prefix + key)
            values[id(value)] = value
    sources += [Source(tuple(names), values[key]) for key, names in by_tensor.items()]
    on_meta = [s.names[0] for s in sources if _local(s.value).is_meta]
    if on_meta:
        raise ValueError(
            f"stream_weights: {on_meta} are on the meta device: materialize the model "
            "(to_empty and init, or load a checkpoint) before streaming its weights"
        )
    return sources


def _plain_entries(module: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    """A module's own state-dict tensors: parameters, then persistent buffers."""
    buffers = [
        (key, buffer)
        for key, buffer in module._buffers.items()
        if key not in module._non_persistent_buffers_set
    ]
    return [*module._parameters.items(), *buffers]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value
