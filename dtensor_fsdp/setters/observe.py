"""FSDPModule's observers (dtensor_fsdp only): the comm trace, the checks before
collectives, the collective watchdog, and ``describe_groups``; bound as methods by
fsdp_module.py."""

from datetime import timedelta

from ..api import FSDPGroupInfo
from ..observe.consistency import CollectiveCheck
from ..observe.flight_recorder import FlightRecorder
from ..observe.trace import CommTrace, TraceObserver
from ..observe.watchdog import DEFAULT_DEADLINE, watchdog_factory
from ..runtime.param_group import FSDPParamGroup
from ..runtime.state import FSDPState, assign_fqns
from .groups import fsdp_state, fsdp_states, tree_groups


def set_comm_trace(self, trace: CommTrace | None) -> None:
    """Record every collective and lifecycle step of this module's tree into
    ``trace`` (``None`` stops recording), named by their paths from this module.
    dtensor_fsdp only: not in torch."""
    states = fsdp_states(self, recurse=True)
    assign_fqns((self,), states)  # type: ignore[arg-type]
    observer = TraceObserver(trace) if trace is not None else None
    for group in tree_groups(self, recurse=True):
        group.set_observer("trace", observer)


def describe_groups(self, recurse: bool = True) -> list[FSDPGroupInfo]:
    """Describe the parameter groups of this module's ``fully_shard`` call, and with
    ``recurse`` those of every call in its tree (each once, in ``modules()`` order):
    their names in ``CommTrace`` events, modules, sizes and reshard setting. Reads
    only: it issues nothing and works on meta and fake tensors too. dtensor_fsdp
    only: not in torch.

    Returns:
        One ``FSDPGroupInfo`` per group.
    """
    return [_describe(group) for group in tree_groups(self, recurse)]


def set_divergence_check(
    self, enabled: bool = True, *, timeout: timedelta | float | None = None
) -> None:
    """Before every FSDP collective of this root's tree, check that all ranks are
    about to issue the same one (same module, phase, kind, size and sequence
    number), so control flow that diverges between ranks raises
    ``CollectiveMismatchError`` on every rank, naming what each rank was about to
    do, instead of aborting (gloo) or hanging (NCCL). Costs one small synchronous
    all-gather per collective. Call it on the root, on every rank. dtensor_fsdp
    only: not in torch.

    Args:
        enabled: switch the check on or off, from the next collective on.
        timeout: how long (seconds or a ``timedelta``) a rank waits for the others
            at one check before raising; ``None``: the process group's timeout.
            A short one also fails legitimately slow ranks (a long evaluation or
            checkpoint on one rank while the others start the next step).
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    state = _root_state_for_checks(self)
    checks = state.check
    finite_grads = isinstance(checks, CollectiveCheck) and checks.finite_grads
    state.set_check(_collective_check(state, enabled, finite_grads, timeout))


def set_nonfinite_grad_check(self, enabled: bool = True) -> None:
    """Before each reduce-scatter of this root's tree, check every rank's unsharded
    gradients for NaN/Inf; if any rank has one, every rank raises
    ``NonFiniteGradError`` naming, per offending rank, the first such parameter,
    before the reduction spreads it to every rank. Off by default: it costs a
    max-abs per gradient and one small all-gather per reduce-scatter, and fp16
    training with a GradScaler expects (and skips) occasional Infs. Call it on the
    root, on every rank. dtensor_fsdp only: not in torch."""
    state = _root_state_for_checks(self)
    checks = state.check
    signatures = isinstance(checks, CollectiveCheck) and checks.signatures
    timeout = checks.timeout if isinstance(checks, CollectiveCheck) else None
    state.set_check(_collective_check(state, signatures, enabled, timeout))


def set_collective_watchdog(
    self, enabled: bool = True, *, deadline: timedelta | float = DEFAULT_DEADLINE
) -> None:
    """Bound how long a rank waits in an FSDP collective. On by default, with a
    60 s deadline: every rank records its FSDP collectives in a ring buffer (no
    communication, no store call: under 1% of a step's host calls), and a host
    wait that lasts ``deadline`` makes every rank publish its records through the
    c10d store and compare them. Only positive evidence is an error: diverged
    ranks (a block skipped, a parameter unused on some ranks only) raise
    ``CollectiveMismatchError`` on every rank, naming which rank diverged, where
    (module, phase, step) and what each rank was doing; a wait the backend failed
    (a rank it killed, its own timeout) is logged at once and raises, naming the
    ranks that stopped answering. A rank that gives no answer (busy in a call that
    holds the GIL) or is merely behind gets a ``CollectiveStragglerWarning`` and
    the wait goes on, up to the process group's own timeout. The
    wait is bounded on the host (CPU tensors: gloo); on an accelerator, where the
    wait is a stream wait, a thread polls the works in flight and, past the
    deadline, compares the records the same way and aborts the process group on
    an error (NCCL; not yet run on a GPU: docs/observe.md). Call it on the
    root, on every rank, in the same order. dtensor_fsdp only: torch's FSDP2 waits
    for the backend's timeout (``set_divergence_check`` is the strict check before
    every collective).

    Args:
        enabled: record and watch (``True``, the default) or neither.
        deadline: how long (seconds or a ``timedelta``) a host waits in one
            collective before the ranks compare records. Far below the process
            group's timeout (NCCL's default is 10 minutes); long enough for a
            legitimately slow collective, which only draws a warning anyway.

    Raises:
        ValueError: ``deadline`` is not positive.
    """
    if isinstance(deadline, (int, float)):
        deadline = timedelta(seconds=deadline)
    if deadline <= timedelta(0):
        raise ValueError(
            f"set_collective_watchdog: deadline must be positive, got {deadline}: pass "
            "seconds, e.g. 60.0 (the default), or set_collective_watchdog(False)"
        )
    state = _root_state_for_checks(self)
    state.make_watchdog = watchdog_factory(deadline) if enabled else None
    if state.ctx is None:
        return  # lazy init builds it
    if isinstance(state.watchdog, FlightRecorder) and state.watchdog.stop_watchdog:
        state.watchdog.stop_watchdog()
    state.set_watchdog(state.make_watchdog(state) if state.make_watchdog else None)


def _root_state_for_checks(self) -> FSDPState:
    # Before lazy init the root is not known yet: it reads its own settings then.
    state = fsdp_state(self)
    if state.ctx is not None and not state.is_root:
        raise ValueError(
            "set_divergence_check / set_nonfinite_grad_check / set_collective_watchdog "
            "apply to a whole FSDP "
            "tree: call them on its root module, the one whose forward runs first"
        )
    return state


def _describe(group: FSDPParamGroup) -> FSDPGroupInfo:
    post_forward = group.post_forward_mesh_info
    return FSDPGroupInfo(
        fqn=group.fqn,
        modules=tuple(group.modules),
        numel=sum(p.sharded_param.numel() for p in group.fsdp_params),  # DTensor: global
        unsharded_nbytes=group.mesh_info.shard_size
        * sum(p.all_gather_nbytes for p in group.fsdp_params),
        shard_size=group.mesh_info.shard_size,
        replicate_size=group.mesh_info.replicate_size,
        reshard_after_forward=(
            post_forward.shard_size if post_forward is not None else group.reshard_after_forward
        ),
    )


def _collective_check(
    root: FSDPState, signatures: bool, finite_grads: bool, timeout: timedelta | None
) -> CollectiveCheck | None:
    """The root's checks before collectives (observe/consistency.py), if any is on. A
    new one per setter call, on every rank alike: the sequence numbers restart."""
    if not (signatures or finite_grads):
        return None
    return CollectiveCheck(
        signatures=signatures,
        finite_grads=finite_grads,
        # Read when naming what other ranks sent, after lazy init: the tree is known.
        fqns=lambda: [g.fqn for s in root.states_in_tree for g in s.groups],
        on_failure=root.reset_iter_state,
        timeout=timeout,
    )
