"""Storage management: free a tensor's memory and give it back, keeping the object.

A padded unsharded param (param.py, extension.py) keeps its tensor object, and the
views over it, across reshards: autograd may have saved them, and the next all-gather
refills the same storage; so its storage is resized in place. The reduce-scatter frees
its all-to-all input the same way once it landed (collectives.py).
"""

import torch


def free_storage(tensor: torch.Tensor) -> None:
    """Release the memory behind ``tensor`` but keep the tensor object (and its views).

    Autograd may have saved ``tensor`` for backward; keeping the object and only
    resizing its storage lets the backward all-gather refill the same storage.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give ``tensor``'s (freed) storage ``nbytes`` again; contents are uninitialized."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def is_storage_freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0
