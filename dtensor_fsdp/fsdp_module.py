"""FSDPModule, the class ``fully_shard`` mixes into each module it shards, with its
lifecycle verbs (``unshard``/``reshard``, ``run_post_backward``) and UnshardHandle. Its
``set_*`` methods are defined by job in setters/ (schedule, comm, observe) and bound
here, in its class body."""

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch.nn as nn

from .graph.pending import reduce_pending
from .graph.switch import group_graphs, is_graph_mode
from .io.load_checks import validate_state_dict
from .io.state_dict import residual_states
from .runtime.param_group import FSDPParamGroup
from .runtime.reduction.error_feedback import attribute_tree
from .runtime.state import FSDPState
from .setters import comm, observe, schedule
from .setters.groups import fsdp_state, fsdp_states, own_groups, tree_groups

# Public module class #


class FSDPModule:
    """Mixed into every module passed to ``fully_shard`` (``isinstance(m, FSDPModule)``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Instances are made by fully_shard's class swap, never constructed directly:
        # ``FSDPLinear(...)`` builds a plain Linear, as in torch.
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        return fsdp_state(self)  # type: ignore[arg-type]

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        return fsdp_states(self, recurse)  # type: ignore[arg-type]

    @property
    def _fsdp_error_feedback(self) -> SimpleNamespace:  # error_feedback.RESIDUALS_ATTR
        """This module's error-feedback residuals as state-dict values, by their params'
        keys (``module._fsdp_error_feedback.layers.0.weight``): the attribute path that
        the state-dict keys ``<module>._fsdp_error_feedback.<param key>`` name, which
        torch's ``get_state_dict`` walks. Empty without error feedback. See [Note:
        error-feedback residuals in state dicts] in error_feedback.py."""
        module: nn.Module = self  # type: ignore[assignment]
        return attribute_tree(residual_states(self._get_fsdp_state(), module))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``to()``, ``to_empty()``, ``half()``, ``cuda()``...: apply to the sharded params,
        then re-derive the group's sharded state from what they became (see [Note:
        re-deriving the sharded state] in group_layout.py)."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in own_groups(self):  # type: ignore[arg-type]
            group.reset_sharded_params()
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # torch raises AssertionError with this wording; the sharded params are views
        # into per-group buffers and hooks close over FSDP state, neither of which a
        # generic deepcopy can rebuild.
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            "dtensor_fsdp: build a new model, fully_shard it, and load_state_dict("
            "model.state_dict()) into it"
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, atomic: keys and every value (type, device,
        shape, dtype) are checked for the whole state dict before any value is copied
        (see ``validate_state_dict``). Values may be sharded DTensors of any placement or
        plain full tensors."""
        original_name = type(self).__mro__[2].__name__  # FSDP<cls>, FSDPModule, <cls>
        validate_state_dict(self, original_name, state_dict, strict, assign)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones. Not recursive."""
        for group in own_groups(self):  # type: ignore[arg-type]
            group.reshard()

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather the parameters and register the unsharded ones. Not recursive.

        Args:
            async_op: return an ``UnshardHandle`` to wait on instead of waiting here.

        Returns:
            An ``UnshardHandle`` if ``async_op``, else ``None``.
        """
        groups = own_groups(self)  # type: ignore[arg-type]
        for group in groups:
            group.unshard(async_op=async_op)
        return UnshardHandle(groups) if async_op else None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, reshard and reset per-iteration
        state so the next iteration starts clean. Call it on the root."""
        self._get_fsdp_state().reset_iter_state()

    def run_post_backward(self) -> None:
        """Run the post-backward of every group in this module's FSDP tree now, then the
        end of backward, as when a backward finishes: gradients accumulated under
        ``set_requires_gradient_sync(False)`` are reduce-scattered (one collective per
        group, none for a group without gradients) and land on the sharded params, and
        each group reshards per ``set_reshard_after_backward``.

        dtensor_fsdp only: torch has no public name for it. torch's pipeline stages do
        the same at the end of a step through torch-internal state (each group's
        ``post_backward()``, then the root's final callback);
        ``dtensor_fsdp.pipelining.PipelineStage`` calls this instead. Call it between
        backwards, on the root or any module of its tree (it acts on the whole tree, as
        torch's does). Before the first forward it does nothing (torch's internal calls
        raise ``AttributeError`` there); with nothing accumulated (a second call
        included) it issues no collective, as torch's.
        """
        root = self._get_fsdp_state().root
        if root is None:
            return  # no forward yet: nothing was accumulated
        if is_graph_mode(root.modules[0]):
            reduce_pending(group_graphs(root.modules[0]))
            return
        groups: dict[int, FSDPParamGroup] = {}
        for module in root.modules:  # pre-order, root first: torch's order of states
            for group in tree_groups(module, recurse=True):
                groups.setdefault(id(group), group)
        for group in groups.values():
            group.post_backward()
        root.finalize_backward()

    # Settings: when the tree reshards, prefetches and syncs (setters/schedule.py) #

    set_is_last_backward = schedule.set_is_last_backward
    set_requires_gradient_sync = schedule.set_requires_gradient_sync
    set_requires_all_reduce = schedule.set_requires_all_reduce
    set_reshard_after_forward = schedule.set_reshard_after_forward
    set_reshard_after_backward = schedule.set_reshard_after_backward
    set_modules_to_forward_prefetch = schedule.set_modules_to_forward_prefetch
    set_modules_to_backward_prefetch = schedule.set_modules_to_backward_prefetch
    set_reduce_scatter_max_input_buffers = schedule.set_reduce_scatter_max_input_buffers
    set_post_optim_event = schedule.set_post_optim_event
    set_unshard_in_backward = schedule.set_unshard_in_backward

    # Settings: what watches its collectives (setters/observe.py) #

    set_comm_trace = observe.set_comm_trace
    describe_groups = observe.describe_groups
    set_divergence_check = observe.set_divergence_check
    set_nonfinite_grad_check = observe.set_nonfinite_grad_check
    set_collective_watchdog = observe.set_collective_watchdog

    # Settings: what and how its collectives communicate (setters/comm.py) #

    set_comm_precision = comm.set_comm_precision
    set_custom_all_gather = comm.set_custom_all_gather
    set_custom_reduce_scatter = comm.set_custom_reduce_scatter
    set_all_reduce_hook = comm.set_all_reduce_hook
    set_reduce_scatter_divide_factor = comm.set_reduce_scatter_divide_factor
    set_gradient_divide_factor = comm.set_gradient_divide_factor
    set_force_sum_reduction_for_comms = comm.set_force_sum_reduction_for_comms
    set_reduce_scatter_unused_params = comm.set_reduce_scatter_unused_params
    set_separate_reduce_scatter_group = comm.set_separate_reduce_scatter_group
    set_allocate_memory_from_process_group_for_comm = (
        comm.set_allocate_memory_from_process_group_for_comm
    )
    set_symm_mem_for_comm = comm.set_symm_mem_for_comm


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gathers and register the unsharded parameters."""
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []
