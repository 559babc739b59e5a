"""Optimizer support for fully-sharded models, built on top of the core.

The core never imports this package: sharded params are plain ``nn.Parameter(DTensor)``
and ``torch.optim`` works on them unchanged. What lives here makes that faster.

- `step_on_local_shards`: one line after building an element-wise ``torch.optim``
  optimizer (AdamW, SGD, ...) makes its ``step()`` run on the params' local tensors,
  bitwise identical to stepping the DTensors, without DTensor's per-op dispatch.
- `clip_grad_norm_` / `get_total_norm`: ``torch.nn.utils``'s, on local tensors with one
  all-reduce per mesh.
- ``Muon``: torch.optim.Muon with Newton-Schulz on whole matrices at owner ranks
  (muon.py; the exchange is owner.py's), and ``split_muon_params`` for its recipe.
"""

from .clip import clip_grad_norm_, get_total_norm
from .local_shards import ELEMENTWISE_OPTIMIZERS, LocalShardStep, step_on_local_shards
from .muon import Muon, split_muon_params

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "LocalShardStep",
    "Muon",
    "clip_grad_norm_",
    "get_total_norm",
    "split_muon_params",
    "step_on_local_shards",
]
