"""torch FSDP2's private state names on our state, for torch's ``FSDPMemTracker``.

torch's ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` measures memory
per module and per category (sharded and unsharded params and grads, all-gather and
reduce-scatter buffers, activations, optimizer states). It is a dispatch mode that
needs to know, at a few points of each module's step, which tensors are FSDP's. It
finds them, and the points, through torch's private state (torch 2.11-2.14), and reads
nothing else of it:

- ``module._get_fsdp_state()`` (ours returns our ``FSDPState``), and on the state:
  ``_fsdp_param_group`` (the group, or None), ``_pre_forward`` and ``_post_forward``
  (the forward hooks' bodies, as ``(module, args, kwargs)`` and ``(module, input,
  output)`` hooks), ``_pre_forward_hook_handle`` and ``_post_forward_hook_handle``
  (removed, then set to the handles of hooks that wrap those bodies; restored on exit);
- on the group: ``fsdp_params``, and ``pre_backward`` and ``post_backward``, replaced by
  wrappers on the instance (ours calls them through the instance, so they take effect);
- on each param: ``sharded_param`` (and its ``.grad``), ``unsharded_param``, and
  ``_unsharded_param.grad`` (the unsharded grad).

Every one of these has a counterpart of the same meaning in ours; this module gives it
torch's name, as properties on our ``FSDPState`` and ``FSDPParam`` classes, installed by
``use_dtensor_fsdp()`` and removed by its ``undo()``. The handles are the core's own
(``FSDPState.forward_hook_handles``), so a handle set here is the one the core holds.

torch's state has one group and one module's hooks; ours may have several (a
``shard_placement_fn`` spreading a call over meshes; ``fully_shard([a, b])``). There
the names raise ``NotImplementedError`` rather than describe part of the state.
"""

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.state import FSDPState

__all__ = ["install_torch_state_names", "uninstall_torch_state_names"]


def _refuse(state: FSDPState, name: str, what: str) -> NotImplementedError:
    # Not an AttributeError (as TorchOnlyMethodError is): raised from a property, it
    # would send Python to FSDPState.__getattr__, whose generic message would replace it.
    return NotImplementedError(
        f"FSDPState.{name}: torch FSDP2's private state has one {what} per fully_shard "
        f"call; this dtensor_fsdp call on {', '.join(type(m).__name__ for m in state.modules)} "
        f"has {len(state.groups) if what == 'group' else len(state.modules)}. torch's "
        "FSDPMemTracker reads it: for this model use torch's plain MemTracker "
        "(torch.distributed._tools.mem_tracker), or dtensor_fsdp.plan()"
    )


def _fsdp_param_group(state: FSDPState) -> FSDPParamGroup | None:
    if len(state.groups) > 1:
        raise _refuse(state, "_fsdp_param_group", "group")
    return state.groups[0] if state.groups else None


def _only_module(state: FSDPState, name: str) -> nn.Module:
    if len(state.modules) != 1:
        raise _refuse(state, name, "module")
    return state.modules[0]


def _pre_forward(state: FSDPState) -> Callable[..., Any]:
    # Our hook body, which ignores its module argument: it is this one module's.
    return state.pre_forward_hook(_only_module(state, "_pre_forward"))


def _post_forward(state: FSDPState) -> Callable[..., Any]:
    return state.post_forward_hook(_only_module(state, "_post_forward"))


def _handle_property(index: int, name: str) -> property:
    """The pre-forward (index 0) or post-forward (1) hook handle of the state's module."""

    def get(state: FSDPState) -> RemovableHandle:
        _only_module(state, name)
        return state.forward_hook_handles[0][index]

    def set_(state: FSDPState, handle: RemovableHandle) -> None:
        _only_module(state, name)
        pair = list(state.forward_hook_handles[0])
        pair[index] = handle
        state.forward_hook_handles[0] = (pair[0], pair[1])

    return property(get, set_)


def _unsharded_param(fsdp_param: FSDPParam) -> nn.Parameter | None:
    return fsdp_param.unsharded_param


_STATE_NAMES: dict[str, property] = {
    "_fsdp_param_group": property(_fsdp_param_group),
    "_pre_forward": property(_pre_forward),
    "_post_forward": property(_post_forward),
    "_pre_forward_hook_handle": _handle_property(0, "_pre_forward_hook_handle"),
    "_post_forward_hook_handle": _handle_property(1, "_post_forward_hook_handle"),
}
_PARAM_NAMES: dict[str, property] = {"_unsharded_param": property(_unsharded_param)}
_CLASSES: tuple[tuple[type, dict[str, property]], ...] = (
    (FSDPState, _STATE_NAMES),
    (FSDPParam, _PARAM_NAMES),
)


def install_torch_state_names() -> None:
    for cls, names in _CLASSES:
        for name, prop in names.items():
            assert name not in vars(cls), f"{cls.__name__}.{name} exists in the core"
            setattr(cls, name, prop)


def uninstall_torch_state_names() -> None:
    for cls, names in _CLASSES:
        for name in names:
            if vars(cls).get(name) is names[name]:
                delattr(cls, name)
