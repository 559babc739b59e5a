"""The streamed full export of a fully-sharded model.

- ``save_full_state_dict(model, path)`` writes a full, unsharded checkpoint from rank 0
  one tensor at a time (memory: the largest tensor), in the safetensors format
  (``safetensors.torch.load_file`` and transformers' ``from_pretrained`` read it; see
  [Note: streamed safetensors] in ``safetensors_file.py``); ``format="torch"`` writes an
  ordinary ``torch.save`` file instead. Either way ``load_full_state_dict(path)`` reads
  it back as a plain state dict; a malformed safetensors file raises ``ValueError``
  naming the file and what is wrong.
"""

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.reduction.error_feedback import (
    is_residual_key,
)
from .safetensors_file import (
    check_written,
    encode_header,
    plan_header,
    read_state_dict,
    write_tensor,
)

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's files are zip archives


def save_full_state_dict(module: nn.Module, path: str, *, format: str = "safetensors") -> None:
    """Write ``module``'s full (unsharded) state dict to ``path``, from rank 0.

    Every rank must call it: each tensor is all-gathered, one at a time. Error-feedback
    residuals (``CommPrecisionPolicy.error_feedback``) are left out: training state, not
    weights. The file appears atomically (written to ``path.tmp``, then renamed): a crash
    mid-write leaves no file at ``path``. If rank 0 cannot write (a full disk, a missing
    directory), it keeps joining the gathers, removes ``path.tmp``, and every rank raises
    the same ``RuntimeError`` once the last tensor is gathered: no rank waits for a rank
    that failed.

    Args:
        module: the (fully-sharded) module.
        path: the file to write.
        format: ``"safetensors"`` streams each tensor to the file as it is gathered, so
            rank 0 holds one full tensor at a time; the finished file is checked with
            ``safetensors.safe_open`` before it is renamed. ``"torch"`` is an ordinary
            ``torch.save`` of a plain state dict, which must be complete in host memory
            on rank 0 before it is written.

    Raises:
        ValueError: a bad ``format``; with ``"safetensors"``, a state-dict value that is
            not a tensor or of a dtype safetensors cannot hold (named, on every rank,
            before anything is gathered or written).
        RuntimeError: writing failed on rank 0 (on every rank, naming rank 0's error;
            chained to it on rank 0).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(
            f"save_full_state_dict: format must be 'safetensors' or 'torch', got {format!r}"
        )
    # The weights only: error-feedback residuals are training state, for checkpoints.
    state_dict = {k: v for k, v in module.state_dict().items() if not is_residual_key(k)}
    header = plan_header(state_dict) if format == "safetensors" else None
    writer = _Writer(f"{path}.tmp", is_writer=not dist.is_initialized() or dist.get_rank() == 0)
    if format == "torch":
        full = {key: _gathered(value, writer.ok) for key, value in state_dict.items()}
        writer.run(torch.save, full, writer.temporary)
    else:
        writer.open(encode_header(header))
        for value in state_dict.values():
            full = _gathered(value, writer.ok)
            writer.run(write_tensor, writer.file, full)
            del full  # before the next gather: one full tensor at a time
        writer.close()
        writer.run(check_written, writer.temporary, header)
    writer.run(os.replace, writer.temporary, path)
    writer.agree(path)


class _Writer:
    """Rank 0's file work in ``save_full_state_dict``: after its first failure it does
    nothing more (the rank still joins every gather), and ``agree`` tells every rank."""

    def __init__(self, temporary: str, is_writer: bool) -> None:
        self.temporary = temporary
        self.is_writer = is_writer
        self.file: Any = None
        self.error: Exception | None = None

    @property
    def ok(self) -> bool:
        """Whether this rank writes and nothing failed: it keeps the gathered tensors."""
        return self.is_writer and self.error is None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.ok:
            return
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it (agree)
            self.error = error

    def open(self, header: bytes) -> None:
        def start() -> None:
            self.file = open(self.temporary, "wb")  # noqa: SIM115 - closed by close()
            self.file.write(header)

        self.run(start)

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            self.run(file.close)
            file.close()  # idempotent; after a failed write it was never closed

    def agree(self, path: str) -> None:
        """Every rank learns rank 0's outcome (one small collective, which also keeps
        them together as a barrier); on a failure the temporary file is removed and
        every rank raises."""
        self.close()
        if self.error is not None:
            with contextlib.suppress(OSError):
                os.remove(self.temporary)
        outcome = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        if dist.is_initialized():
            outcomes: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, outcome)
            outcome = outcomes[0]
        if outcome is not None:
            raise RuntimeError(
                f"save_full_state_dict: writing {path} failed on rank 0: {outcome}; "
                "nothing was written at that path"
            ) from self.error


def _gathered(value: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """``value`` in full on the host where ``keep`` (the writer); every rank gathers,
    since a DTensor's ``full_tensor`` is a collective, and the others drop it at once."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().cpu() if keep else None


def load_full_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read a file written by `save_full_state_dict` (either format) as a plain state
    dict, for an unsharded model.

    Raises:
        FileNotFoundError: ``path`` does not exist (``OSError`` for other reasons it
            cannot be opened).
        ValueError: ``path`` is not a valid safetensors file; the message names it and
            keeps safetensors' reason. (A file that starts as a zip archive is read with
            ``torch.load(weights_only=True)``, and raises what that raises.)
    """
    with open(path, "rb") as file:
        is_torch_save = file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    if is_torch_save:
        return torch.load(path, weights_only=True)
    return read_state_dict(path)
