"""Plan before you launch: predict one rank's memory, collectives and compute of a
training step by simulating it on fake tensors (see ``simulate.py``); the CLI for the
built-in Llama presets is ``python -m dtensor_fsdp.plan`` (``__main__.py``)."""

from .recorders import TimelinePoint
from .report import GroupPlan, Plan
from .settings import PlanSettings, shard_largest_module_list
from .simulate import plan, replan

__all__ = [
    "GroupPlan",
    "Plan",
    "PlanSettings",
    "TimelinePoint",
    "plan",
    "replan",
    "shard_largest_module_list",
]
