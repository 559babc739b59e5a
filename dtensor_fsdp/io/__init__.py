"""State I/O: state dicts (sharded and full), checkpoints and their file formats."""
