"""Step an element-wise ``torch.optim`` optimizer on the sharded params' local tensors.

[Note: local-shard step]
``torch.optim`` steps sharded params as DTensors, so every op of the update pays
DTensor's dispatch (sharding propagation, placement checks, re-wrapping), which is pure
host overhead: an element-wise update on ``Shard``/``Replicate`` DTensors is the same
update on their local tensors. ``step_on_local_shards(optimizer)`` makes ``step()``
run on the local tensors instead:

1. before the step, each DTensor param in ``optimizer.param_groups`` is replaced by its
   alias, ``local.detach()`` of its local tensor (same storage, a plain leaf), whose
   ``.grad`` is the DTensor grad's local tensor; ``optimizer.state`` is replaced by a
   twin keyed by the aliases, whose per-param dicts hold the local tensors of the
   DTensor state values (plain values, e.g. the scalar ``step``, are shared);
2. the optimizer's own ``step`` runs unchanged on plain tensors;
3. after the step (also when it raises) everything is put back: the DTensor params in
   the groups, the original ``optimizer.state`` object, each state value the DTensor
   it was before (updated in place through its local tensor), and state the step
   created with the param's local shape wrapped into a DTensor with the param's mesh,
   placements, global shape and stride, which is what ``torch.optim`` creates with
   ``torch.zeros_like(param)`` on a DTensor; new entries are appended in the order the
   step made them. Scalar state stays the plain tensor ``torch.optim`` makes for
   DTensor params too.

The aliases, the twin state and the alias lists are built once and reused while
nothing changed (the ``Swap``, local_state.py): each step checks, by identity, that
the groups hold the same params, each param the same local tensor (``module.to()`` or
a re-sharding replaces it), ``optimizer.state`` the same dict (``load_state_dict``
replaces it) with the same per-param dicts and values; any difference rebuilds the swap. So a step costs
a few attribute reads per param on top of the update itself.

Outside ``step()`` nothing differs, so ``optimizer.state_dict()``,
``torch.distributed.checkpoint.state_dict.get_state_dict`` and DCP resharding, LR
schedulers, ``zero_grad``, ``torch.amp.GradScaler`` (its unscale runs on the DTensor
grads before ``step``) and CPU offload see what they see without it. Each element of
the update is computed by the same kernels on the same values, so the parameters and
state are bitwise those of the DTensor step.

Why a wrapper of ``step`` and not ``register_step_pre_hook``/``register_step_post_hook``:
a post hook does not run when the step raises, which would leave aliases in the param
groups; a wrapper restores in ``finally``. A closure passed to ``step`` runs with
everything restored (it calls the model, ``zero_grad`` and backward, which must see the
DTensors), then the new grads are mapped again. Step hooks registered on the optimizer
run inside the wrapper, so they see the aliases, as the update does.

Why per-parameter local tensors and not the group's flat sharded buffer (all_gather_layout.py,
[Note: sharded buffer]): see benchmarks/README.md for the measurement (the flat step is
not faster enough to pay for it on the CPU here: the update is memory-bound once
DTensor is gone). A flat step also needs the grads and every state tensor as views of
flat buffers with the sharded buffer's layout, which ``load_state_dict`` (new state
tensors) and gradient accumulation (grads not views of one reduce-scatter output)
break, and param groups with other hyper-parameters (no weight decay for norms) split.
"""

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .local_state import (
    GroupSwap,
    LocalParam,
    State,
    Swap,
    append_new_state,
    check_param,
    local_value,
    param_name,
    same_spec,
    sync_state,
    unchanged,
)

# torch.optim classes whose update of each element reads only that element of the
# param, its grad and its state (plus hyper-parameters and scalar state). Exact types:
# a subclass may override ``step``. Not here: LBFGS (dot products), SparseAdam (sparse
# grads), Adafactor (row and column factors), Muon (orthogonalizes the whole matrix).
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls
    for cls in (
        getattr(torch.optim, name, None)
        for name in (
            "SGD",
            "Adam",
            "AdamW",
            "Adagrad",
            "Adadelta",
            "Adamax",
            "ASGD",
            "NAdam",
            "RAdam",
            "RMSprop",
            "Rprop",
        )
    )
    if cls is not None
)

# Set on the installed step function (and copied by functools.wraps onto any wrapper an
# LR scheduler puts around it): the handle, so a second registration is refused.
_HANDLE_ATTR = "_dtensor_fsdp_local_shard_step"

class LocalShardStep:
    """Handle returned by `step_on_local_shards`; ``remove()`` turns it off."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._removed = False
        self._swap: Swap | None = None
        self._is_swapped = False
        # The step it wraps: an instance attribute already there (an LR scheduler's
        # wrapper), else None for the class's step.
        self._previous: Callable[..., Any] | None = optimizer.__dict__.get("step")

    def remove(self) -> None:
        """Step on the DTensors again, as ``torch.optim`` does without this handle."""
        self._removed = True
        self._swap = None
        installed = self.optimizer.__dict__.get("step")
        func = getattr(installed, "__func__", None)
        if func is not None and getattr(func, _HANDLE_ATTR, None) is self:
            if self._previous is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._previous
        # Otherwise something (an LR scheduler) wrapped our step since: it stays in place
        # and passes straight through.

    @property
    def is_removed(self) -> bool:
        return self._removed

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The optimizer's step, on local tensors (see [Note: local-shard step])."""
        if self._removed:
            return self._call_previous(args, kwargs)
        args, kwargs = self._wrap_closure(args, kwargs)
        self._to_local()
        try:
            return self._call_previous(args, kwargs)
        finally:
            self._to_dtensor()

    def _call_previous(self, args: tuple, kwargs: dict) -> Any:
        if self._previous is None:
            return type(self.optimizer).step(self.optimizer, *args, **kwargs)
        return self._previous(*args, **kwargs)

    def _wrap_closure(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A closure re-evaluates the model (forward, ``zero_grad``, backward): run it with
        the DTensors in place, then map the new grads to the aliases."""
        in_args = bool(args)
        closure = args[0] if in_args else kwargs.get("closure")
        if closure is None:
            return args, kwargs

        def local_closure() -> Any:
            self._to_dtensor()
            try:
                return closure()
            finally:
                self._to_local()

        if in_args:
            return (local_closure, *args[1:]), kwargs
        return args, {**kwargs, "closure": local_closure}

    # The swap #

    def _to_local(self) -> None:
        """Step 1 of [Note: local-shard step]. Everything is validated before anything
        changes, so a refused param or grad leaves the optimizer as it was."""
        swap = self._swap
        if swap is None or not self._is_current(swap):
            # Dropped first: a build that raises must not leave a half-updated swap.
            self._swap = None
            swap = self._swap = self._build_swap(swap)
        grads = [self._local_grad(entry) for entry in swap.entries]
        for entry, grad in zip(swap.entries, grads, strict=True):
            entry.alias.grad = grad
        for group, group_swap in zip(self.optimizer.param_groups, swap.groups, strict=True):
            group["params"] = group_swap.aliases
        self.optimizer.state = swap.local_state
        self._is_swapped = True

    def _to_dtensor(self) -> None:
        """Step 3 of [Note: local-shard step]; nothing to do if `_to_local` refused."""
        if not self._is_swapped:
            return
        self._is_swapped = False
        swap = self._swap
        optimizer = self.optimizer
        optimizer.state = swap.state
        for group, group_swap in zip(optimizer.param_groups, swap.groups, strict=False):
            group["params"] = group_swap.params
        local_state = swap.local_state
        for entry in swap.entries:
            entry.alias.grad = None
            lstate = local_state.get(entry.alias)
            if lstate is not None and not unchanged(
                lstate, entry.lstate, entry.names, entry.lvalues
            ):
                sync_state(entry, lstate)
        if len(local_state) != swap.synced_len:
            append_new_state(swap)

    def _is_current(self, swap: Swap) -> bool:
        """Whether nothing the swap was built from changed (by identity)."""
        optimizer = self.optimizer
        state = optimizer.state
        if state is not swap.state or len(optimizer.param_groups) != len(swap.groups):
            return False
        for group, group_swap in zip(optimizer.param_groups, swap.groups, strict=True):
            params = group["params"]
            if (
                params is not group_swap.params
                or len(params) != len(group_swap.members)
                or any(a is not b for a, b in zip(params, group_swap.members, strict=True))
                or group.get("differentiable", False)
            ):
                return False
        for entry in swap.entries:
            dstate = state.get(entry.param)
            if entry.param._local_tensor is not entry.source or not (
                dstate is entry.dstate
                and (dstate is None or unchanged(dstate, dstate, entry.names, entry.dvalues))
            ):
                return False
        return all(state.get(p) is swap.local_state.get(p) for p in swap.plain)

    def _build_swap(self, stale: Swap | None) -> Swap:
        """Aliases and the twin state from scratch (reusing ``stale``'s aliases whose
        local tensors stayed); raises before changing the optimizer."""
        optimizer = self.optimizer
        previous = {} if stale is None else {id(e.param): e for e in stale.entries}
        entries: dict[int, LocalParam] = {}
        plain: dict[int, torch.Tensor] = {}
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            if group.get("differentiable", False):
                raise ValueError(
                    f"step_on_local_shards: param_groups[{index}] has differentiable=True; "
                    "a step on local tensors cuts the autograd graph through the DTensor "
                    "params: remove the handle (handle.remove()) for a differentiable step"
                )
            aliases = []
            for position, param in enumerate(group["params"]):
                if not isinstance(param, DTensor):
                    plain[id(param)] = param
                    aliases.append(param)
                    continue
                entry = entries.get(id(param))
                if entry is None:
                    check_param(param, param_name(group, index, position))
                    old = previous.get(id(param))
                    local = param._local_tensor
                    # Keep an alias while its local tensor stays: user code may hold it.
                    alias = (
                        old.alias
                        if old is not None and old.param is param and old.source is local
                        else local.detach()
                    )
                    entry = LocalParam(param, local, alias)
                    entries[id(param)] = entry
                aliases.append(entry.alias)
            groups.append(GroupSwap(group["params"], tuple(group["params"]), aliases))
        local_state: State = defaultdict(dict)
        for key, dstate in optimizer.state.items():
            entry = entries.get(id(key))
            if entry is not None and entry.param is key:
                lstate = {name: local_value(key, name, value) for name, value in dstate.items()}
                entry.synced(dstate, lstate)
                local_state[entry.alias] = lstate
            elif plain.get(id(key)) is key:
                local_state[key] = dstate
        return Swap(
            optimizer.state,
            local_state,
            groups,
            list(entries.values()),
            list(plain.values()),
            synced_len=len(local_state),
        )

    def _local_grad(self, entry: LocalParam) -> torch.Tensor | None:
        grad = entry.param.grad
        if grad is None:
            return None
        if not isinstance(grad, DTensor) or not same_spec(grad, entry.param):
            param = entry.param
            where = (
                f"{grad.placements} on {grad.device_mesh}" if isinstance(grad, DTensor) else "plain"
            )
            raise ValueError(
                f"step_on_local_shards: the grad of {self._name(param)} is {where}, the "
                f"param {param.placements} on {param.device_mesh}: the local step needs "
                "the grad in the param's placements; redistribute it first"
            )
        return grad._local_tensor

    def _name(self, param: torch.Tensor) -> str:
        for index, group in enumerate(self.optimizer.param_groups):
            for position, member in enumerate(group["params"]):
                if member is param:
                    return param_name(group, index, position)
        return f"a param of shape {tuple(param.shape)}"


def step_on_local_shards(
    optimizer: torch.optim.Optimizer, *, elementwise: bool = False
) -> LocalShardStep:
    """Make ``optimizer.step()`` update the DTensor params' local tensors directly.

    One line after building the optimizer; the training loop is unchanged::

        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
        dtensor_fsdp.optim.step_on_local_shards(optimizer)

    The result is bitwise that of ``optimizer.step()`` on the DTensors, without
    DTensor's dispatch on every op (see [Note: local-shard step]). Between steps the
    optimizer is exactly as ``torch.optim`` leaves it: DTensor params in its groups and
    DTensor state, so ``state_dict()``, ``get_state_dict``/DCP (resharding N -> M
    ranks), LR schedulers (built before or after this call), ``zero_grad``,
    ``torch.amp.GradScaler`` and CPU offload work as before. Plain (non-DTensor) params
    in the same optimizer are stepped as they are.

    Args:
        optimizer: a ``torch.optim`` optimizer over ``fully_shard``-ed (or any
            ``Shard``/``Replicate`` DTensor) params. Its class must be one of
            ``ELEMENTWISE_OPTIMIZERS`` (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, ASGD,
            NAdam, RAdam, RMSprop, Rprop), or ``elementwise=True``.
        elementwise: declare that ``optimizer``'s update of each param element reads only
            that element of the param, its grad and its state tensors, plus
            hyper-parameters and scalar (0-dim) state: no norms, sums, matmuls or
            reshapes over a param (e.g. Lion; not LBFGS, Adafactor or Muon). Its state
            tensors must be made like the param (``torch.zeros_like(p)``,
            ``p.new_zeros(p.shape)``, ``grad.clone()``), as torch's are.

    Returns:
        A `LocalShardStep` handle; ``handle.remove()`` steps on the DTensors again.

    Raises:
        TypeError: ``optimizer`` is not a known element-wise optimizer and
            ``elementwise`` is not set.
        ValueError: it already steps on local shards.

    At each ``step()`` (before anything changes), ``ValueError`` naming the param if a
    DTensor param has a ``Partial`` placement or is 0-dim, its grad or a state tensor
    has another mesh or other placements, or a group has ``differentiable=True``.
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS and not elementwise:
        known = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"step_on_local_shards: {type(optimizer).__qualname__} is not known to be "
            f"element-wise (known: {known}). If its update of each param element reads "
            "only that element of the param, grad and state, pass elementwise=True"
        )
    existing = getattr(getattr(optimizer, "step", None), _HANDLE_ATTR, None)
    if existing is not None and not existing.is_removed:
        raise ValueError(
            f"step_on_local_shards: this {type(optimizer).__qualname__} already steps on "
            "local shards; call it once per optimizer"
        )
    handle = LocalShardStep(optimizer)
    wrapped = handle._previous or type(optimizer).step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return handle.step(*args, **kwargs)

    # The wrapped step's name, docstring, signature (GradScaler inspects it) and
    # attributes (an LR scheduler's ``_wrapped_by_lr_sched`` marker, when it wrapped the
    # step before us, so it does not warn that the step was overridden).
    functools.update_wrapper(step, wrapped)
    setattr(step, _HANDLE_ATTR, handle)
    # A bound method, as the class's step is: an LR scheduler built afterwards wraps it
    # through ``step.__func__``.
    optimizer.step = step.__get__(optimizer, type(optimizer))
    return handle
