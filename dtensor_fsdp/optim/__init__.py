"""Optimizer support for fully-sharded models, built on top of the core.

The core never imports this package: sharded params are plain ``nn.Parameter(DTensor)``
and ``torch.optim`` works on them unchanged. What lives here makes that faster.
"""
