"""Observing FSDP's communication: the user-visible trace (``CommTrace``) and the
cross-rank consistency checks."""
