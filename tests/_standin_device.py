"""A stand-in accelerator for CPU-only torch: the device type ``standin`` (torch's
PrivateUse1 slot, registered from Python), whose tensors have a shape and a dtype but no
storage.

Why: CPU offload's bugs are about *where* FSDP puts a tensor when the mesh's device is
not the host. On a CPU mesh every tensor is on the CPU whatever FSDP does, so a CPU-only
suite cannot see them: ``DTensor.from_local`` moving the offloaded shards to the mesh's
device went unnoticed until an H200 ran it. On a ``DeviceMesh("standin", ...)`` the
mesh's device type differs from the host's, as on CUDA, while the offloaded tensors stay
real CPU tensors: a sharded param that FSDP puts on the mesh's device lands on
``standin:0``, where the test sees it, exactly as it landed on ``cuda:0``.

Limits (a stand-in, not a device): a standin tensor holds no values (copies into it
drop them; its views are new storage-less tensors, not aliases), and it has no streams,
no storage resize, no pinned host memory and no collectives. So it covers what FSDP
does with host tensors on an accelerator mesh: ``fully_shard``, ``to_empty``,
``init_unsharded``, a state-dict load, an optimizer step and ``clip_grad_norm_`` on
host shards and grads (their collectives run on host tensors, over the gloo group
behind the mesh). Not lazy init (it needs streams), forward or backward: those run on
a CPU mesh here and on CUDA in the GPU checks.
torch's ``fully_shard`` runs on it only for a module already on the device or on meta:
for CPU params its ``param.data = param.to(device)`` needs tensor types that a CPU
tensor can adopt, which a storage-less one is not.

Registration is process-wide and permanent (one PrivateUse1 name per process): call
`register` only in a spawned child, never in the pytest process.
"""

import torch
from torch.utils import backend_registration

DEVICE_TYPE = "standin"

# Keeps the kernel registrations alive (they are dropped with the Library object).
_LIBRARY: list[torch.library.Library] = []


def is_supported() -> bool:
    """Whether this torch can register a Python backend (private APIs, in torch 2.13; a
    release without them skips the stand-in tests)."""
    return hasattr(backend_registration, "_setup_privateuseone_for_python_backend") and hasattr(
        getattr(torch._C, "_acc", None), "create_empty_tensor"
    )


def register() -> None:
    """Register the ``standin`` device type and the few kernels FSDP's init calls on it."""
    backend_registration._setup_privateuseone_for_python_backend(DEVICE_TYPE)
    lib = torch.library.Library("aten", "IMPL")
    _LIBRARY.append(lib)
    # Factories: the unsharded param and copies to the device (``tensor.to(device)``).
    lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    # Copies to, from and on the device drop the values (there are none to move).
    lib.impl("_copy_from", lambda src, dst, non_blocking=False: dst, "PrivateUse1")
    lib.impl("copy_", lambda self, src, non_blocking=False: self, "PrivateUse1")
    lib.impl("zero_", lambda self: self, "PrivateUse1")
    # In-place init (``nn.init``, ``reset_parameters``) inside ``init_unsharded``, whose
    # full parameters live on the mesh's device: nothing to write.
    for op in ("uniform_", "normal_", "fill_.Scalar"):
        lib.impl(op, lambda self, *args, **kwargs: self, "PrivateUse1")
    # Views (slicing a param into its shard, DTensor's ``view_as``): shape only.
    lib.impl("view", lambda self, size: _new(_view_shape(self, size), self.dtype), "PrivateUse1")
    lib.impl(
        "as_strided",
        lambda self, size, stride, storage_offset=None: _new(size, self.dtype),
        "PrivateUse1",
    )


def _new(size: torch.Size | list[int], dtype: torch.dtype | None) -> torch.Tensor:
    return torch._C._acc.create_empty_tensor(list(size), dtype or torch.get_default_dtype())


def _view_shape(tensor: torch.Tensor, size: list[int]) -> torch.Size:
    return torch.empty(tensor.shape, device="meta").view(size).shape  # resolves a -1


def _empty_memory_format(
    size: list[int],
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor:
    return _new(size, dtype)


def _empty_strided(
    size: list[int],
    stride: list[int],
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    return _new(size, dtype)
