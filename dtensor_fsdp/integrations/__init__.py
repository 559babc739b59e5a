"""Adapters that switch frameworks (Lightning Fabric, Hugging Face's Trainer and
loaders, accelerate) from torch's FSDP2 to dtensor_fsdp. Apart from the core: they
import ``torch.distributed.fsdp``, which ``import dtensor_fsdp`` never does."""

from .frameworks import FrameworkSwitch, use_dtensor_fsdp

__all__ = ["FrameworkSwitch", "use_dtensor_fsdp"]
