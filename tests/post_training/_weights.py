"""Shared by the post-training tests: the reference a weight stream is compared with
(a full state dict with the name map applied, written here independently of
``dtensor_fsdp.post_training``'s own planning), collecting a stream, the live bytes of
the tensors a stream allocates, and a few training steps of a Hugging Face model."""

import weakref
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtensor_fsdp.post_training import Target


def train_hf(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> torch.nn.Module:
    """``steps`` AdamW steps of a Hugging Face causal LM on ``tokens`` (its own shifted
    loss), on the parameters that require grad (a LoRA model's adapters)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """torch's full state dict (every rank gets every tensor), the reference route."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def mapped(
    state_dict: dict[str, torch.Tensor], name_map=None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """``state_dict`` as the engine gets it: cast (floating point), rearranged, fused."""
    out, fused = {}, {}
    for name, tensor in state_dict.items():
        target = name if name_map is None else name_map(name)
        if target is None:
            continue
        target = Target(target) if isinstance(target, str) else target
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if target.rearrange is not None:
            tensor = target.rearrange(tensor)
        if target.fuse:
            fused.setdefault(target.name, (target, {}))[1][name] = tensor
        else:
            out[target.name] = tensor
    for name, (target, parts) in fused.items():
        out[name] = torch.cat([parts[n] for n in target.fuse], target.fuse_dim)
    return out


def collect(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Every streamed tensor, by name (copies: the stream empties its buckets)."""
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket}


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names missing on either side, or whose tensors differ in dtype, shape or bits."""
    bad = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            bad.append(name)
    return bad


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops under it create and that are still alive:
    ``live`` now, ``peak`` the most at once. A storage is counted once, however many
    views share it; tensors made before the mode (the model) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor:
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        self._seen.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes
