"""Plan before you launch: predict one rank's memory, collectives and compute of a
training step by simulating it on fake tensors (see ``simulate.py``), and choose the
groups under a memory budget (``auto.py``); the CLI for the built-in Llama presets is
``python -m dtensor_fsdp.plan`` (``__main__.py``)."""

from .auto import AutoGroup, AutoPlan, auto_shard
from .recorders import TimelinePoint
from .report import GroupPlan, Plan
from .settings import PlanSettings, shard_largest_module_list
from .simulate import plan, replan

__all__ = [
    "AutoGroup",
    "AutoPlan",
    "GroupPlan",
    "Plan",
    "PlanSettings",
    "TimelinePoint",
    "auto_shard",
    "plan",
    "replan",
    "shard_largest_module_list",
]
