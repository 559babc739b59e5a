"""Initialization of a sharded model as the unsharded model would be: ``init_unsharded``
and its lazy, memory-bounded full parameters (meta-device init)."""
