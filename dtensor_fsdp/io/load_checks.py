"""Checks before a state dict is loaded into a fully-sharded module, so that
``FSDPModule.load_state_dict`` changes everything or nothing (see [Note: atomic load])."""

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.reduction.error_feedback import (
    RESIDUALS_ATTR,
    is_residual_key,
)
from ..runtime.state import state_of


def validate_state_dict(
    module: nn.Module,
    module_name: str,
    state_dict: Mapping[str, Any],
    strict: bool,
    assign: bool = False,
) -> None:
    """Raise, naming every bad key, if ``state_dict`` cannot load into ``module`` whole,
    so that ``load_state_dict`` changes nothing or everything; see [Note: atomic load].

    Checked for every tensor entry of ``module.state_dict()`` that ``state_dict`` has:
    the value is tensor-like; not on the meta device (nothing to copy); a DTensor only
    where the module holds one, or where the load pre-hook shards it (FSDP params take
    plain full tensors too); a DTensor value's mesh includes this rank; the same shape;
    a dtype the copy can cast to the module's (as ``copy_``: float into int, complex
    into float and the like are allowed, as ``nn.Module`` allows them); with ``assign``
    a parameter that requires grad gets a floating-point or complex value. Values are
    not read: NaN and Inf load. Any device is fine (the copy moves the data), as in
    ``nn.Module``.

    Raises:
        RuntimeError: ``nn.Module``'s type for the same errors, with its phrases:
            missing or unexpected keys (``strict``), or any bad value above.
    """
    expected = module.state_dict()
    problems = []
    if strict:
        # Error-feedback residuals are optional: missing, they restart at zero; where
        # an FSDP module keeps none, they are ignored (see [Note: error-feedback
        # residuals in state dicts]).
        fsdp_prefixes = _fsdp_prefixes(module)
        missing = sorted(k for k in set(expected) - set(state_dict) if not is_residual_key(k))
        unexpected = sorted(
            k
            for k in set(state_dict) - set(expected)
            if not (is_residual_key(k) and k.split(RESIDUALS_ATTR)[0] in fsdp_prefixes)
        )
        if missing:
            problems.append(f"missing keys: {missing}")
        if unexpected:
            problems.append(f"unexpected keys: {unexpected}")
    # The load pre-hook shards full values of FSDP params and residuals.
    sharded_keys = _sharded_keys(module) | {k for k in expected if is_residual_key(k)}
    requires_grad = {
        name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad
    }
    for key in sorted(set(expected) & set(state_dict)):
        want = expected[key]
        if not isinstance(want, torch.Tensor):
            continue  # extra state (get_extra_state): any object, the module's to check
        problem = _value_problem(
            want, state_dict[key], key in sharded_keys, assign and key in requires_grad
        )
        if problem is not None and is_residual_key(key) and problem.startswith("shape"):
            problem += (
                " (an error-feedback residual: one row per data-parallel rank; saved at "
                "another data-parallel world size, drop it to restart it at zero)"
            )
        if problem is not None:
            problems.append(f"'{key}': {problem}")
    if problems:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {module_name} (nothing was loaded):\n  "
            + "\n  ".join(problems)
        )


# [Note: atomic load] nn.Module.load_state_dict copies module by module and collects
# errors as it goes, so a bad value raises after the values before it were copied (torch's
# FSDP2 too). FSDPModule.load_state_dict runs validate_state_dict first, which refuses
# everything the copy (or our pre-hook's sharding of a full tensor) would fail on, so
# the copy itself cannot fail on a value. What is left is a failure of the machine
# (out of memory, a collective of a redistribution that fails).


def _fsdp_prefixes(module: nn.Module) -> set[str]:
    """The state-dict key prefixes (``""``, ``"layers.0."``) of the modules under
    ``module`` (itself included) that ``fully_shard`` was called on."""
    return {
        f"{name}." if name else ""
        for name, submodule in module.named_modules(remove_duplicate=False)
        if state_of(submodule) is not None
    }


def _sharded_keys(module: nn.Module) -> set[str]:
    """The state-dict keys (relative to ``module``) that ``_shard_loaded_values``
    converts to the sharded param's placements: FSDP-managed parameters."""
    keys = set()
    # nn.Module's load visits a shared submodule once per path, so every path counts.
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        state = state_of(submodule)
        if state is None:
            continue
        for fsdp_param in state.fsdp_params():
            for slot in fsdp_param.slots:
                if slot.root is submodule:
                    keys.add(f"{prefix}.{slot.key}" if prefix else slot.key)
    return keys


def _value_problem(
    want: torch.Tensor, got: Any, is_sharded_by_hook: bool, must_require_grad: bool
) -> str | None:
    """Why ``got`` cannot be copied into the module's ``want``, or ``None``."""
    if not torch.overrides.is_tensor_like(got):
        return (
            f"expected torch.Tensor or Tensor-like object from checkpoint but received {type(got)}"
        )
    local = got.to_local() if isinstance(got, DTensor) else got
    if local.is_meta:
        return (
            "Cannot copy out of meta tensor; no data! The value is on the meta device: "
            "load a state dict that holds the values (e.g. one read from a checkpoint)"
        )
    if isinstance(got, DTensor) and got.device_mesh.get_coordinate() is None:
        return (
            f"a DTensor on a mesh without rank {dist.get_rank()}, which holds none of it: "
            "pass a DTensor on a mesh of every rank, or the full tensor"
        )
    if isinstance(got, DTensor) and not isinstance(want, DTensor):
        return (
            "a DTensor for a plain tensor of the module (aten.copy_ got mixed torch.Tensor "
            "and DTensor): pass value.full_tensor()"
        )
    if isinstance(want, DTensor) and not isinstance(got, DTensor) and not is_sharded_by_hook:
        return (
            "a plain tensor for a DTensor that fully_shard does not manage (aten.copy_ got "
            "mixed torch.Tensor and DTensor): pass a DTensor with the module's placements"
        )
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    cast_error = _cast_error(got.dtype, want.dtype)
    if cast_error is not None:
        return f"cannot copy {got.dtype} into {want.dtype}: {cast_error}"
    if must_require_grad and not (got.dtype.is_floating_point or got.dtype.is_complex):
        return (
            f"with assign=True the {got.dtype} value becomes the parameter, which requires "
            "grad: Only Tensors of floating point and complex dtype can require gradients; "
            "load with assign=False to cast it"
        )
    return None


def _cast_error(src: torch.dtype, dst: torch.dtype) -> str | None:
    """The error ``copy_`` raises copying ``src`` into ``dst``, or ``None``: one element
    on the CPU, so the answer is copy_'s own (quantized, sub-byte and bit dtypes fail)."""
    if src == dst:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex -> real warns that it drops .imag
            torch.empty(1, dtype=dst).copy_(torch.empty(1, dtype=src))
    except Exception as exc:  # noqa: BLE001 - whatever copy_ raises is the answer
        return str(exc).split("\n")[0]
    return None
