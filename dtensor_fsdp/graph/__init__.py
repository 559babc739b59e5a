"""Graph mode: the whole training step as compiled graphs, FSDP's collectives inside.

switch.py puts a sharded model in graph mode (gathers in the forward, no hooks),
gather.py is the traceable gather and reduction, backend.py the compile backends and
their passes, compile.py the entry point ``dtensor_fsdp.compile``. See docs/graph.md.
"""
