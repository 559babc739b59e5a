"""dtensor_fsdp: per-parameter fully sharded data parallelism on DTensor.

A drop-in for ``torch.distributed.fsdp``'s FSDP2 API: switch with one import line.
"""

# torch's FSDP registers the "fake" c10d backend as a side effect of its import (FSDP1's
# _flat_param imports torch's fake_pg), and FSDP users rely on it: torchtitan gives
# size-1 mesh axes that backend. Importing dtensor_fsdp alone does the same. The module
# is torch-private; a torch without it just goes without the registration.
try:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
except ImportError:  # pragma: no cover
    pass

from .api import (
    AllGather,
    CommPrecisionPolicy,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPGroupInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
)
from .fsdp_module import FSDPModule, UnshardHandle
from .fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from .graph.compile import compile
from .graph.switch import disable_graph_mode, enable_graph_mode
from .init.unsharded import init_unsharded
from .io.full_export import load_full_state_dict, save_full_state_dict
from .observe.consistency import CollectiveMismatchError, NonFiniteGradError
from .observe.flight_recorder import CollectiveStragglerWarning
from .observe.trace import CommEvent, CommTrace, DeviceTiming, LifecycleEvent
from .optim import Muon, clip_grad_norm_, get_total_norm, split_muon_params, step_on_local_shards
from .plan import AutoPlan, Plan, auto_shard, plan

__all__ = [
    "AllGather",
    "AutoPlan",
    "CPUOffloadPolicy",
    "CollectiveMismatchError",
    "CollectiveStragglerWarning",
    "CommEvent",
    "CommPrecisionPolicy",
    "CommTrace",
    "DataParallelMeshDims",
    "DeviceTiming",
    "FSDPGroupInfo",
    "FSDPModule",
    "LifecycleEvent",
    "MixedPrecisionPolicy",
    "Muon",
    "NonFiniteGradError",
    "OffloadPolicy",
    "Plan",
    "ReduceScatter",
    "UnshardHandle",
    "auto_shard",
    "clip_grad_norm_",
    "compile",
    "disable_graph_mode",
    "enable_graph_mode",
    "fully_shard",
    "get_total_norm",
    "init_unsharded",
    "load_full_state_dict",
    "plan",
    "register_fsdp_forward_method",
    "save_full_state_dict",
    "share_comm_ctx",
    "split_muon_params",
    "step_on_local_shards",
]
