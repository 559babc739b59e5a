"""``use_dtensor_fsdp()``: one line that makes frameworks built on torch's FSDP2 use ours.

Most FSDP2 users never call ``fully_shard`` themselves. A framework calls it (accelerate's
``fsdp2_prepare_model``, transformers' ``apply_fully_sharded_data_parallelism``) or
inspects the modules afterwards with ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
(Lightning Fabric's ``no_backward_sync``, the Trainer's reshard before building the
optimizer, torch's pipeline stages). Our ``FSDPModule`` is not torch's, so without help a
framework silently treats our modules as plain ones: Fabric reduces on every
micro-batch, the Trainer leaves an evaluated root unsharded. The switch does three things:

- **isinstance**: every module sharded while it is on is also an instance of
  ``TorchFSDPModuleBase``, a subclass of torch's ``FSDPModule``, placed after ours and
  the original class in the MRO (through the core's ``add_fsdp_class_base``), so our
  methods win and ``__new__``, ``deepcopy`` and pickling behave as without it. The few
  methods only torch's class has (``_set_unshard_async_op``) raise
  ``TorchOnlyMethodError``, naming the call, instead of running torch's code on our
  state.
- **fully_shard**: torch's ``fully_shard``, ``register_fsdp_forward_method`` and
  ``share_comm_ctx`` are replaced by ours in ``torch.distributed.fsdp`` and its
  re-exporting modules, and wherever an already imported module bound them by name
  (transformers' ``transformers/distributed/fsdp.py`` does ``from
  torch.distributed._composable.fsdp import fully_shard`` at import time). torch's
  policies passed to it (``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ...) become
  ours, field by field. ``fully_shard.state(module)``, torch's private state accessor,
  raises ``TorchOnlyMethodError``. Each replacement is a function of the switch's own
  (it calls ours), so that ``undo()`` finds every binding of it by identity, also in
  a module imported while the switch was on (which bound the replacement by name), and
  puts torch's back there too.
- **state names**: the few private names of torch's state that torch's
  ``FSDPMemTracker`` reads are given to ours, with our meaning (``torch_state_names``).

This module imports ``torch.distributed.fsdp`` (the class to subclass and the names to
replace); the core never does, so ``import dtensor_fsdp`` alone changes nothing in torch.
"""

import dataclasses
import functools
import sys
from types import ModuleType, TracebackType
from typing import Any, Self

import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from .. import api
from ..fsdp_module import FSDPModule
from ..fully_shard import (
    add_fsdp_class_base,
    fully_shard,
    register_fsdp_forward_method,
    remove_fsdp_class_base,
    share_comm_ctx,
)
from .torch_state_names import install_torch_state_names, uninstall_torch_state_names

__all__ = ["FrameworkSwitch", "TorchFSDPModuleBase", "TorchOnlyMethodError", "use_dtensor_fsdp"]


class TorchOnlyMethodError(NotImplementedError, AttributeError):
    """A framework reached a private part of torch's FSDP2 that dtensor_fsdp does not
    have. A NotImplementedError, and an AttributeError so that ``hasattr`` probes read
    it as absent."""


def _refuse(name: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TorchOnlyMethodError(
            f"{type(self).__name__}.{name}() is a private method of torch's FSDP2 "
            "(torch.distributed.fsdp.FSDPModule); this module was sharded by dtensor_fsdp "
            "(switched in with dtensor_fsdp.integrations.use_dtensor_fsdp()), which does not "
            "implement it. The caller (usually a framework) relies on torch's internals: use "
            "the public FSDPModule API, or torch's fully_shard for this model"
        )

    refused.__name__ = name
    return refused


def _torch_only_methods() -> dict[str, Any]:
    """A refusal for each method torch's FSDPModule has and ours does not, read from the
    installed torch (2.13: ``_set_unshard_async_op``), so that a torch release adding
    one gets a refusal, not torch's code running on our state."""
    return {
        name: _refuse(name)
        for name, value in vars(_TorchFSDPModule).items()
        if callable(value) and not name.startswith("__") and not hasattr(FSDPModule, name)
    }


class TorchFSDPModuleBase(_TorchFSDPModule):
    """torch's FSDPModule as a base of our ``FSDP<cls>`` classes, after ours and
    ``cls`` in the MRO: instances pass ``isinstance(m, torch.distributed.fsdp.
    FSDPModule)``; every method torch's class has and ours lacks is refused (below)."""


for _name, _method in _torch_only_methods().items():
    setattr(TorchFSDPModuleBase, _name, _method)


def _refused_state(module: Any) -> Any:
    raise TorchOnlyMethodError(
        f"fully_shard.state({type(module).__name__}) returns torch FSDP2's private state; "
        "fully_shard is dtensor_fsdp's (switched in with "
        "dtensor_fsdp.integrations.use_dtensor_fsdp()), whose state is not torch's. The "
        "caller relies on torch's internals: use the public FSDPModule API"
    )


# torch's policy classes and ours: the same dataclass fields. By name, as a torch
# release may lack one (DataParallelMeshDims is recent).
_POLICIES = {
    getattr(torch_fsdp, name): getattr(api, name)
    for name in (
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
    )
    if hasattr(torch_fsdp, name)
}


def _as_ours(value: Any) -> Any:
    ours = _POLICIES.get(type(value))
    if ours is None:
        return value
    return ours(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})


@functools.wraps(fully_shard)
def _fully_shard(module: Any, **kwargs: Any) -> Any:
    return fully_shard(module, **{key: _as_ours(value) for key, value in kwargs.items()})


_fully_shard.state = _refused_state  # type: ignore[attr-defined]


def _switched(ours: Any) -> Any:
    """``ours`` behind a function only the switch hands out (see the module docstring)."""

    @functools.wraps(ours)
    def switched(*args: Any, **kwargs: Any) -> Any:
        return ours(*args, **kwargs)

    return switched


# torch's function -> ours, keyed by the id of torch's (the tuple keeps it alive, so
# the id stays its own).
_REPLACEMENTS: dict[int, tuple[Any, Any]] = {
    id(theirs): (theirs, ours)
    for theirs, ours in (
        (getattr(torch_fsdp, "fully_shard", None), _fully_shard),
        (
            getattr(torch_fsdp, "register_fsdp_forward_method", None),
            _switched(register_fsdp_forward_method),
        ),
        (getattr(torch_fsdp, "share_comm_ctx", None), _switched(share_comm_ctx)),
    )
    if theirs is not None  # share_comm_ctx is recent
}
# Ours -> torch's, keyed by the id of ours (each is the switch's own function).
_RESTORES: dict[int, tuple[Any, Any]] = {
    id(ours): (ours, theirs) for theirs, ours in _REPLACEMENTS.values()
}

# The namespaces torch defines them in: left alone, because torch's own code calls them
# there by name (its fully_shard reads ``fully_shard.state(module)`` of the module it
# is sharding), and a reference to torch's fully_shard taken before the switch (a test's
# reference run) must keep working. Frameworks import the public names.
_DEFINING_NAMESPACES = [
    getattr(theirs, "__wrapped__", theirs).__globals__ for theirs, _ in _REPLACEMENTS.values()
]


class FrameworkSwitch:
    """What one ``use_dtensor_fsdp()`` call changed; ``undo()`` (or leaving its
    ``with`` block) restores it. A call made while the switch was already on changed
    nothing, and its ``undo()`` does nothing."""

    def __init__(self, added_base: bool) -> None:
        self._added_base = added_base

    def undo(self) -> None:
        """Put torch's names back wherever a module holds ours (also one imported while
        the switch was on) and stop adding torch's FSDPModule to modules sharded from
        now on. Modules sharded while the switch was on stay instances of it."""
        global _active
        if self._added_base:
            _swap_bound_names(_RESTORES)
            remove_fsdp_class_base(TorchFSDPModuleBase)
            uninstall_torch_state_names()
            _active = None
        self._added_base = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()


# The switch in effect, if any: it is process-wide, as the names it replaces are.
_active: FrameworkSwitch | None = None


def use_dtensor_fsdp() -> FrameworkSwitch:
    """Make frameworks written for torch's FSDP2 use dtensor_fsdp. Call it once, before
    the framework shards the model (or before you call ``fully_shard`` for it)::

        from dtensor_fsdp.integrations import use_dtensor_fsdp
        use_dtensor_fsdp()

    From then on, torch's ``fully_shard`` (wherever a framework finds it) is ours, and
    modules ours shards pass ``isinstance(m, torch.distributed.fsdp.FSDPModule)``.
    Calling it again while it is on changes nothing.

    Returns:
        A ``FrameworkSwitch``: ``undo()`` it, or use it as a context manager, to switch
        back (tests do).
    """
    global _active
    if _active is not None:
        return FrameworkSwitch(added_base=False)
    add_fsdp_class_base(TorchFSDPModuleBase)
    install_torch_state_names()
    _swap_bound_names(_REPLACEMENTS)
    _active = FrameworkSwitch(added_base=True)
    return _active


def _swap_bound_names(swaps: dict[int, tuple[Any, Any]]) -> None:
    """Bind ``new`` wherever an imported module binds ``old`` (``swaps``: id(old) ->
    (old, new)), by identity, so that an alias such as ``from torch.distributed.fsdp
    import fully_shard as fsdp2`` is found too; modules imported later find what
    torch's modules hold."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(module, ModuleType) or not isinstance(namespace, dict):
            continue
        if any(namespace is defining for defining in _DEFINING_NAMESPACES):
            continue
        for name, value in list(namespace.items()):
            pair = swaps.get(id(value))
            if pair is not None and pair[0] is value:
                setattr(module, name, pair[1])
