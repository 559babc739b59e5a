"""State dicts of fully-sharded modules, and a streamed full export.

- ``model.state_dict()`` returns the sharded DTensors under the original FQNs, with no
  communication and no FSDP-specific key mangling; a pre-hook reshards the group first
  (the root stays unsharded after a ``no_grad`` forward), so it never returns unsharded
  parameters, as torch's FSDP2. Each value is a zero-copy alias of the shard with a
  storage of its own, which ``dcp.async_save``'s stager can copy (see [Note: state-dict
  values own their storage]). The hooks sit on every module that holds FSDP
  parameters, as torch's, so a plain submodule's state dict (``model.out``) is sharded
  in and out too. With ``CommPrecisionPolicy(error_feedback=True)`` only, the state
  dict of a module passed to ``fully_shard`` also holds the error-feedback residuals
  (see [Note: error-feedback residuals in state dicts] in ``error_feedback.py``).
- ``model.load_state_dict(sd)`` takes sharded DTensors (any placements or mesh: they
  are redistributed) and plain full tensors (each rank keeps its own chunk: no rank
  broadcasts the model). ``FSDPModule.load_state_dict`` checks the keys and every value
  (type, meta device, shape, dtype, DTensor mesh) before it copies anything, so a bad
  state dict leaves the model as it was (torch's raises after copying the rest). Values
  are copied into the sharded storage in place, cast to the parameter's dtype as
  ``nn.Module`` and torch's FSDP2 do: the zero-copy all-gather input stays intact. With
  ``assign=True`` the registered sharded params stay the same objects; into a model
  built on ``meta`` they take the loaded shards, and the group's sharded buffer is
  re-derived from them (``_take_assigned``).
- ``save_full_state_dict(model, path)`` writes a full, unsharded checkpoint from rank 0
  one tensor at a time (memory: the largest tensor), in the safetensors format
  (``safetensors.torch.load_file`` and transformers' ``from_pretrained`` read it; see
  [Note: streamed safetensors] in ``safetensors_file.py``); ``format="torch"`` writes an
  ordinary ``torch.save`` file instead. Either way ``load_full_state_dict(path)`` reads
  it back as a plain state dict; a malformed safetensors file raises ``ValueError``
  naming the file and what is wrong.
"""

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.reduction.error_feedback import (
    RESIDUALS_ATTR,
    is_residual_key,
    load_residual_state,
    residual_key,
    residual_layout,
    residual_state,
)
from ..runtime.state import FSDPState, state_of
from ..runtime.tensor_utils import wrap_local
from .safetensors_file import (
    check_written,
    encode_header,
    plan_header,
    read_state_dict,
    write_tensor,
)

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's files are zip archives


@dataclass(frozen=True)
class _HeldParam:
    """An FSDP parameter registered on a module: its group, and its name there."""

    group: FSDPParamGroup
    fsdp_param: FSDPParam
    name: str


def register_state_dict_hooks(state: FSDPState) -> None:
    """Hook every module that holds one of ``state``'s parameters so that its state dict
    is sharded in and out: a plain submodule inside a group too (``model.out`` of the
    root's group), not only the modules passed to ``fully_shard``, as torch's FSDP2
    hooks every module with FSDP params (``FSDPParamGroup._register_state_dict_hooks``
    and ``FSDPParam``'s post-load hook)."""
    held: dict[int, tuple[nn.Module, list[_HeldParam]]] = {}  # by module id
    for group in state.groups:
        for fsdp_param in group.fsdp_params:
            for slot in fsdp_param.slots:
                _, params = held.setdefault(id(slot.module), (slot.module, []))
                params.append(_HeldParam(group, fsdp_param, slot.name))
    for module, params in held.values():
        groups = list({id(p.group): p.group for p in params}.values())
        module.register_state_dict_pre_hook(_reshard_before_state_dict(groups))
        module.register_state_dict_post_hook(_own_storage_values(params))
        module.register_load_state_dict_pre_hook(_shard_loaded_values(groups, params))
        module.register_load_state_dict_post_hook(_adopt_assigned(params))
    # The residuals are keyed under the module passed to fully_shard (see [Note:
    # error-feedback residuals in state dicts]).
    for module in state.modules:
        module.register_state_dict_post_hook(_add_residuals(state))
        module.register_load_state_dict_pre_hook(_take_residuals(state))


def residual_states(state: FSDPState, root: nn.Module) -> dict[str, DTensor]:
    """The error-feedback residuals of ``root``'s params (``root``: one of ``state``'s
    modules) as state-dict values, by their params' keys relative to ``root``; empty
    without error feedback. See [Note: error-feedback residuals in state dicts]."""
    states = {}
    for group in state.groups:
        for fsdp_param in group.reduction.error_feedback_params():
            slot = fsdp_param.slots[0]  # a tied param's residual is saved once
            if slot.root is root:
                residual = group.reduction.error_feedback.residual(fsdp_param)
                states[slot.key] = residual_state(fsdp_param, residual)
    return states


def _add_residuals(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for key, value in residual_states(state, module).items():
            state_dict[residual_key(prefix, key)] = value

    return hook


def _take_residuals(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        _load_residuals(state, module, state_dict, prefix)

    return hook


def _reshard_before_state_dict(groups: list[FSDPParamGroup]) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        for group in groups:
            group.reshard()

    return hook


def _own_storage_values(params: list[_HeldParam]) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for held in params:
            key = prefix + held.name
            value = state_dict.get(key)
            # keep_vars=True hands out the registered Parameter itself: left as it is.
            if isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
                state_dict[key] = _with_own_storage(value)

    return hook


# [Note: state-dict values own their storage]
# A sharded param's local tensor is a view into its group's sharded buffer ([Note:
# sharded buffer]): every param after the first has a nonzero storage offset, and a
# DTensor built on it inherits that offset on its own (data-less) wrapper storage. torch's
# async checkpoint stager (StateDictStager._offload_tensor, used by dcp.async_save) takes
# a tensor with ``data_ptr() != 0`` for one with a storage of its own and copies that
# storage: for such a DTensor the wrapper's invalid one, which raises "Attempted to call
# copy_() on an invalid python storage". torch's FSDP2 never meets it: each of its
# sharded params owns an offset-0 storage. So the state dict hands out each value over
# an alias of its local tensor's bytes with a storage of its own (DLPack: zero-copy, the
# same memory, kept alive by the alias): offset 0, the stager then copies exactly the
# shard, and writes into the value (``dcp.load`` in place) reach the sharded param, as
# torch's. Only the state dict sees the alias; the params stay views of the buffer
# (the all-gather reads it in place). Unlike a view, the alias has its own version
# counter, so `_reshard_if_stale` misses a ``dcp.load`` into it alone; the documented
# route, ``dcp.load`` then ``load_state_dict`` (``set_state_dict``), copies into the
# params (counted) after our pre-hook resharded them.


def _with_own_storage(value: DTensor) -> DTensor:
    """``value`` (a sharded param's state-dict value) over a zero-copy alias of its
    local tensor with a storage of its own, at offset 0. See [Note: state-dict values
    own their storage]."""
    local = value.to_local()
    if type(local) is not torch.Tensor:
        return value  # an all-gather extension's own subclass tensor, not a view
    try:
        alias = torch.from_dlpack(local.detach())  # same shape, stride, memory; offset 0
    except (ValueError, BufferError):
        # A device DLPack does not cover (meta: no bytes; a PrivateUse1 backend): the
        # view itself, which every path but the async stager takes.
        return value
    return wrap_local(alias, value.device_mesh, value.placements, value.shape, value.stride())


def _shard_loaded_values(
    groups: list[FSDPParamGroup], params: list[_HeldParam]
) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for group in groups:
            group.reshard()
        for held in params:
            key = prefix + held.name
            if key in state_dict:
                state_dict[key] = _to_sharded_value(
                    held.fsdp_param, state_dict[key], _load_device(held)
                )

    return hook


def _load_residuals(
    state: FSDPState, root: nn.Module, state_dict: dict[str, Any], prefix: str
) -> None:
    """Take ``root``'s error-feedback residuals out of ``state_dict`` (``nn.Module``
    would call them unexpected) into the residuals. A param loaded without its residual
    restarts it at zero; a residual for a param that keeps none is ignored, with a
    warning. See [Note: error-feedback residuals in state dicts]."""
    for group in state.groups:
        feedback = group.reduction.error_feedback
        for fsdp_param in group.reduction.error_feedback_params():
            slot = fsdp_param.slots[0]
            if slot.root is not root:
                continue
            key = residual_key(prefix, slot.key)
            if key in state_dict:
                mesh, placements = residual_layout(fsdp_param)
                value = _to_placements(
                    state_dict.pop(key), mesh, placements, fsdp_param.compute_device
                )
                load_residual_state(fsdp_param, feedback.residual(fsdp_param), value)
            elif prefix + slot.key in state_dict:
                feedback.reset(fsdp_param)
    ignored = [key for key in state_dict if key.startswith(f"{prefix}{RESIDUALS_ATTR}.")]
    for key in ignored:
        del state_dict[key]
    if ignored:
        warnings.warn(
            f"error-feedback residuals ignored for {ignored}: these params keep none "
            "(error feedback off, filtered out, or one rank per shard group)",
            stacklevel=2,
        )


def _adopt_assigned(params: list[_HeldParam]) -> Callable[..., None]:
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        taken = [p.group for p in params if _take_assigned(p, module)]
        for group in {id(g): g for g in taken}.values():
            # The group's last module loaded: its sharded buffer is re-derived from what
            # the sharded params hold now. A slot still replaced belongs to a module whose
            # post-hook runs later (an ancestor's own params), which re-derives then.
            if not any(p.is_replaced() for p in group.fsdp_params):
                group.reset_sharded_params()

    return hook


def _load_device(held: _HeldParam) -> torch.device:
    """Where a loaded value's shard goes: with the sharded param; for one still on
    ``meta`` (a model built on meta, loaded with ``assign=True``) where the group will
    keep it, the mesh's device (the CPU under CPU offload)."""
    local = held.fsdp_param.registered_local()
    if not local.is_meta:
        return local.device
    return torch.device("cpu") if held.group.offload is not None else held.group.mesh_info.device


def _to_sharded_value(fsdp_param: FSDPParam, value: torch.Tensor, device: torch.device) -> DTensor:
    """A state-dict value for this parameter, in the sharded param's placements.

    A plain tensor is taken as the full parameter and this rank keeps its chunk, on
    ``device``; a DTensor with other placements or another mesh is redistributed. No
    rank sends the whole model to the others.
    """
    layout = fsdp_param.layout
    return _to_placements(value, layout.mesh, layout.placements, device)


def _to_placements(
    value: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    device: torch.device,
) -> DTensor:
    """``value`` (a DTensor, or a plain tensor taken as the full value, moved to
    ``device``) as a DTensor on ``mesh`` with ``placements``."""
    if isinstance(value, DTensor):
        if value.device_mesh == mesh and tuple(value.placements) == placements:
            return value
        value = value.full_tensor() if value.device_mesh != mesh else value
    if not isinstance(value, DTensor):
        # Replicated on ``device`` (the host under CPU offload), so the redistribution
        # below only slices this rank's chunk out of it there: DTensor.from_local
        # would move it to the mesh's device type first.
        local = value.to(device)
        value = wrap_local(local, mesh, [Replicate()] * mesh.ndim, local.shape, local.stride())
    return value.redistribute(mesh, placements)


def _take_assigned(held: _HeldParam, module: nn.Module) -> bool:
    """After ``load_state_dict(assign=True)`` registered a new Parameter in this slot,
    make its values the sharded param's, which stays the registered object (README,
    differences) in every slot. Returns whether there was one.

    Materialized, the values are copied into the sharded param's local tensor in place,
    cast to its dtype. On ``meta`` there is nothing to copy into: the sharded param
    takes the assigned local tensor, moved to where the group keeps it (the host under
    CPU offload, as torch's pinned offload moves it: a DTensor on the device mesh holds
    its shard on the device), by ``swap_tensors``, as ``nn.Module._apply`` swaps a
    DTensor param for ``to_empty``; the group re-derives its sharded buffer from it,
    as after ``to_empty`` ([Note: re-deriving the sharded state] in param_group.py).
    """
    fsdp_param = held.fsdp_param
    assigned = module._parameters.get(held.name)
    param = fsdp_param.sharded_param
    if assigned is param or assigned is None:
        return False
    assert isinstance(assigned, DTensor), f"{fsdp_param.fqn}: the load pre-hook shards it"
    with torch.no_grad():
        local = assigned.to_local().to(_load_device(held), fsdp_param.dtype)  # (*local_shape)
        if fsdp_param.registered_local().is_meta:
            adopted = nn.Parameter(fsdp_param._sharded_dtensor(local), param.requires_grad)
            torch.utils.swap_tensors(param, adopted)
        else:
            fsdp_param.registered_local().copy_(local)
    fsdp_param._register(param)
    return True


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


def save_full_state_dict(module: nn.Module, path: str, *, format: str = "safetensors") -> None:
    """Write ``module``'s full (unsharded) state dict to ``path``, from rank 0.

    Every rank must call it: each tensor is all-gathered, one at a time. Error-feedback
    residuals (``CommPrecisionPolicy.error_feedback``) are left out: training state, not
    weights. The file appears atomically (written to ``path.tmp``, then renamed): a crash
    mid-write leaves no file at ``path``. If rank 0 cannot write (a full disk, a missing
    directory), it keeps joining the gathers, removes ``path.tmp``, and every rank raises
    the same ``RuntimeError`` once the last tensor is gathered: no rank waits for a rank
    that failed.

    Args:
        module: the (fully-sharded) module.
        path: the file to write.
        format: ``"safetensors"`` streams each tensor to the file as it is gathered, so
            rank 0 holds one full tensor at a time; the finished file is checked with
            ``safetensors.safe_open`` before it is renamed. ``"torch"`` is an ordinary
            ``torch.save`` of a plain state dict, which must be complete in host memory
            on rank 0 before it is written.

    Raises:
        ValueError: a bad ``format``; with ``"safetensors"``, a state-dict value that is
            not a tensor or of a dtype safetensors cannot hold (named, on every rank,
            before anything is gathered or written).
        RuntimeError: writing failed on rank 0 (on every rank, naming rank 0's error;
            chained to it on rank 0).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(
            f"save_full_state_dict: format must be 'safetensors' or 'torch', got {format!r}"
        )
    # The weights only: error-feedback residuals are training state, for checkpoints.
    state_dict = {k: v for k, v in module.state_dict().items() if not is_residual_key(k)}
    header = plan_header(state_dict) if format == "safetensors" else None
    writer = _Writer(f"{path}.tmp", is_writer=not dist.is_initialized() or dist.get_rank() == 0)
    if format == "torch":
        full = {key: _gathered(value, writer.ok) for key, value in state_dict.items()}
        writer.run(torch.save, full, writer.temporary)
    else:
        writer.open(encode_header(header))
        for value in state_dict.values():
            full = _gathered(value, writer.ok)
            writer.run(write_tensor, writer.file, full)
            del full  # before the next gather: one full tensor at a time
        writer.close()
        writer.run(check_written, writer.temporary, header)
    writer.run(os.replace, writer.temporary, path)
    writer.agree(path)


class _Writer:
    """Rank 0's file work in ``save_full_state_dict``: after its first failure it does
    nothing more (the rank still joins every gather), and ``agree`` tells every rank."""

    def __init__(self, temporary: str, is_writer: bool) -> None:
        self.temporary = temporary
        self.is_writer = is_writer
        self.file: Any = None
        self.error: Exception | None = None

    @property
    def ok(self) -> bool:
        """Whether this rank writes and nothing failed: it keeps the gathered tensors."""
        return self.is_writer and self.error is None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.ok:
            return
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it (agree)
            self.error = error

    def open(self, header: bytes) -> None:
        def start() -> None:
            self.file = open(self.temporary, "wb")  # noqa: SIM115 - closed by close()
            self.file.write(header)

        self.run(start)

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            self.run(file.close)
            file.close()  # idempotent; after a failed write it was never closed

    def agree(self, path: str) -> None:
        """Every rank learns rank 0's outcome (one small collective, which also keeps
        them together as a barrier); on a failure the temporary file is removed and
        every rank raises."""
        self.close()
        if self.error is not None:
            with contextlib.suppress(OSError):
                os.remove(self.temporary)
        outcome = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        if dist.is_initialized():
            outcomes: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, outcome)
            outcome = outcomes[0]
        if outcome is not None:
            raise RuntimeError(
                f"save_full_state_dict: writing {path} failed on rank 0: {outcome}; "
                "nothing was written at that path"
            ) from self.error


def _gathered(value: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """``value`` in full on the host where ``keep`` (the writer); every rank gathers,
    since a DTensor's ``full_tensor`` is a collective, and the others drop it at once."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().cpu() if keep else None


def load_full_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read a file written by `save_full_state_dict` (either format) as a plain state
    dict, for an unsharded model.

    Raises:
        FileNotFoundError: ``path`` does not exist (``OSError`` for other reasons it
            cannot be opened).
        ValueError: ``path`` is not a valid safetensors file; the message names it and
            keeps safetensors' reason. (A file that starts as a zip archive is read with
            ``torch.load(weights_only=True)``, and raises what that raises.)
    """
    with open(path, "rb") as file:
        is_torch_save = file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    if is_torch_save:
        return torch.load(path, weights_only=True)
    return read_state_dict(path)
