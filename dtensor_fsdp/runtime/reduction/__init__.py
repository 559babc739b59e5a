"""The gradient reduction of one group: reduce-scatter, the HSDP all-reduce across
replicas, and landing the reduced gradients on the sharded params' ``.grad``."""
