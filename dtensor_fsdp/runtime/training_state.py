"""TrainingState: where a group is in the iteration (the second of the two enums that
carry the truth; `ShardedState`, param.py, is the first)."""

from enum import Enum, auto

import torch


def is_in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (torch's
    ``is_bw``)."""
    return torch._C._current_graph_task_id() != -1


class TrainingState(Enum):
    """Where a group is in the iteration."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
