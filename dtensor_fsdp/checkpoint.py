"""``dtensor_fsdp.checkpoint``: the public checkpoint API (verified, resumable
checkpoints of a sharded model and its optimizers); implemented in ``io/verified_checkpoint.py``."""

from .io.verified_checkpoint import (
    EXTRA_FILE,
    MARKER,
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "EXTRA_FILE",
    "MARKER",
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
