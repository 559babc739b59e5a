"""Optimizer support for fully-sharded models, built on top of the core.

The core never imports this package: sharded params are plain ``nn.Parameter(DTensor)``
and ``torch.optim`` works on them unchanged. What lives here makes that faster.

- ``Muon``: torch.optim.Muon with Newton-Schulz on whole matrices at owner ranks
  (muon.py; the exchange is owner.py's), and ``split_muon_params`` for its recipe.
"""

from .muon import Muon, split_muon_params

__all__ = ["Muon", "split_muon_params"]
