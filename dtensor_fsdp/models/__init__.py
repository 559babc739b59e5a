"""Plain-PyTorch models used by the training script, tests and benchmarks (no FSDP code)."""
