"""How the ranks of a checkpoint save or load agree on every step's outcome.

[Note: agreeing on failure] Every step of a save or load that ranks carry out on their
own (rank 0 preparing the staging directory, writing ``extra.pt``, the marker, the
rename; every rank reading the marker, verifying its stripe, reading ``extra.pt``,
copying into the model) ends in ``agree``: one ``all_gather_object`` of each rank's
outcome. If any rank failed, every rank raises the same ``CheckpointError``, naming the
step, the failing ranks and the first failure (type and message), chained to the
original exception on the rank that raised it. DCP's own collectives (``dcp.save``,
``dcp.load``) already gather every rank's failure; theirs become the same kind of
``CheckpointError`` (``agree_dcp``). So no rank is left waiting in a collective for a rank
that raised: the failure reaches every rank as soon as the failing step ends (3 to
50 ms from the call on 2 gloo ranks; tests/io/test_checkpoint_agreement.py). A rank
that *dies* (killed, out of memory) is not caught here: the others wait in their next
collective until the process group's timeout, or until the launcher stops them.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .checkpoint_files import CheckpointError

T = TypeVar("T")


def agree(step: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, this rank's part of ``step``, then learn whether every rank's part
    succeeded: one ``all_gather_object`` of the outcomes.

    Returns:
        ``fn``'s result on this rank.

    Raises:
        CheckpointError: on every rank if ``fn`` raised on any: the same message on
            every rank, chained to the original on the rank that raised it.
    """
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - any failure: every rank must hear of it
        result, error = None, exc
    outcomes = all_gather(None if error is None else describe(error))
    failures = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
    if failures:
        raise failed(step, failures) from error
    return result  # type: ignore[return-value]


def agree_dcp(step: str, fn: Callable[[], Any]) -> None:
    """Run ``dcp.save`` or ``dcp.load``, which gather every rank's failure into a
    ``CheckpointException`` (a ``BaseException``) raised on every rank, and raise it as
    the same ``CheckpointError`` as ``agree`` would."""
    try:
        fn()
    except dcp.CheckpointException as exc:
        # failures: {rank: (exception, traceback)} in torch 2.11-2.14.
        failures = {
            rank: describe(failure[0] if isinstance(failure, tuple) else failure)
            for rank, failure in sorted((getattr(exc, "failures", None) or {}).items())
        }
        raise failed(step, failures or {current_rank(): describe(exc)}) from exc


def only_on(is_mine: bool, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn(*args)`` as a step that only this rank does if ``is_mine`` (rank 0's work)."""
    return (lambda: fn(*args)) if is_mine else (lambda: None)


def describe(error: BaseException) -> str:
    # Our own errors already say what and where; others need their type.
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def failed(step: str, failures: dict[int, str]) -> CheckpointError:
    first, message = next(iter(failures.items()))
    others = [rank for rank in failures if rank != first]
    also = f" (and on ranks {others})" if others else ""
    return CheckpointError(f"{step} failed on rank {first}{also}: {message}")


# ---------------------------------------------------------------------------
# Process group helpers (also usable in one process without a group)
# ---------------------------------------------------------------------------


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * current_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_to_rank0(value: Any) -> dict[int, Any] | None:
    """Every rank's ``value`` keyed by global rank, on rank 0 (``None`` elsewhere or if
    no rank gave one). Only for values known to pickle: a pickling error would raise on
    one rank before the collective."""
    if not dist.is_initialized():
        return None if value is None else {0: value}
    gathered: list[Any] | None = [None] * current_world_size() if current_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    if gathered is None or all(v is None for v in gathered):
        return None
    return {rank: v for rank, v in enumerate(gathered) if v is not None}
