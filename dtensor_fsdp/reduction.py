"""GradientReduction: one group's gradients, from unsharded grads to sharded ``.grad``.

Post-backward hands it the group's unsharded grads: it packs them into one
reduce-scatter (zeros for unused parameters if asked), and when the scheduler finishes
that collective, reduces over HSDP's replicate axis (one all-reduce, or a partial sum
kept for later with ``set_requires_all_reduce(False)``), divides once by the data
parallel world size (or the user's factor), runs the user's all-reduce hook and lands
each parameter's chunk on its sharded ``.grad``.
"""

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .api import CommPrecisionPolicy, ReduceScatter
from .collectives import (
    QuantizedAllReduceResult,
    QuantizedReduceScatterResult,
    ReduceScatterResult,
    ReductionPlan,
    all_reduce,
    finish_quantized_all_reduce,
    finish_quantized_reduce_scatter,
    finish_reduce_scatter,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reduce_scatter,
)
from .consistency import CollectiveCheck
from .mesh import MeshInfo
from .param import FSDPParam
from .scheduler import CommContext
from .streams import CommStreams, StreamRole
from .trace import DeviceTiming

# Reduce dtypes whose range lets the collective sum before dividing.
_NO_OVERFLOW_RISK = (torch.float32, torch.bfloat16)


class GradientReduction:
    """Reduces one group's gradients; holds the reduction's ``FSDPModule.set_*`` knobs."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        mesh_info: MeshInfo,
        record_comm: Callable[..., None],
        timing_event: Callable[[], object | None],
        offload: bool,
    ) -> None:
        """
        Args:
            fsdp_params: the group's parameters, in its buffer order.
            mesh_info: the group's data-parallel mesh.
            record_comm: the group's trace recorder (kind, nbytes, issued_s, wait_s, ...).
            timing_event: the group's device timing events for the trace (or None).
            offload: CPU offload: the sharded grads land in host memory.
        """
        self.fsdp_params = fsdp_params
        self.mesh_info = mesh_info
        self._record_comm = record_comm
        self._timing_event = timing_event
        self.offload = offload
        # CPU offload on an accelerator: the event after this backward's asynchronous
        # device-to-host grad copies; the host waits for it at the end of backward.
        self.offload_event: object | None = None
        self.requires_all_reduce = True  # HSDP: all-reduce over the replicate axis
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.custom_reduce_scatter: ReduceScatter | None = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        # set_all_reduce_hook(stream=): the accelerator stream the hook runs on; None: the
        # current one. Unused on the host.
        self.all_reduce_hook_stream: object | None = None
        # set_separate_reduce_scatter_group: a process group over the shard ranks for the
        # reduce-scatters alone; None: the shard group, shared with the all-gathers.
        self.separate_reduce_scatter_group: dist.ProcessGroup | None = None
        self.reduce_scatter_unused_params = False
        self.comm_precision: CommPrecisionPolicy | None = None
        # CommPrecisionPolicy.error_feedback: per quantized param, its (W, padded chunk
        # numel) fp32 quantization error of the last reduce-scatter.
        self._residuals: dict[FSDPParam, torch.Tensor] = {}

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """The process group the gradient reduce-scatters (and their checks) run on."""
        if self.separate_reduce_scatter_group is not None:
            return self.separate_reduce_scatter_group
        return self.mesh_info.shard_group

    def set_separate_reduce_scatter_group(
        self, enable: bool, new_groups: dict[tuple[int, ...], dist.ProcessGroup]
    ) -> None:
        """Give the reduce-scatters their own process group over the shard ranks (see
        ``FSDPModule.set_separate_reduce_scatter_group``), or with ``enable=False`` the
        shard group back. ``new_groups`` (shard ranks -> group) is shared by one call's
        groups, so groups sharding over the same ranks share one new process group."""
        if not enable:
            self.separate_reduce_scatter_group = None
            return
        ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_group))
        if ranks not in new_groups:
            # Enabled already: keep that group. Otherwise only this rank set's members
            # create it (HSDP: each replica its own), hence local synchronization.
            new_groups[ranks] = (
                self.separate_reduce_scatter_group
                if self.separate_reduce_scatter_group is not None
                else dist.new_group(
                    list(ranks), use_local_synchronization=True, group_desc="fsdp_reduce_scatter"
                )
            )
        self.separate_reduce_scatter_group = new_groups[ranks]

    def set_comm_precision(self, policy: CommPrecisionPolicy | None) -> None:
        self.comm_precision = policy
        self._residuals.clear()

    def discard_error_feedback(self) -> None:
        """After a failed iteration: its errors belong to gradients never applied."""
        self._residuals.clear()

    def _quantizes(
        self, fsdp_param: FSDPParam, policy: CommPrecisionPolicy | None, *, replicate_leg: bool
    ) -> bool:
        """Whether ``fsdp_param``'s gradient travels encoded on the shard-axis
        reduce-scatter, or with ``replicate_leg`` on HSDP's replicate all-reduce."""
        return (
            policy is not None
            and policy.reduce_scatter is not None
            and (
                replicate_leg
                or (
                    not policy.replicate_only
                    and self.custom_reduce_scatter is None
                    and self.mesh_info.shard_size > 1  # one rank: nothing on the wire
                )
            )
            and fsdp_param.reduce_dtype.is_floating_point
            and policy.param_filter(fsdp_param.fqn, fsdp_param.sharded_param)
        )

    def reduce_scatter(self, ctx: CommContext, fqn: str) -> None:
        """Issue one reduce-scatter of every unsharded grad of the group (``fqn``); ``ctx``
        finishes it (waits, reduces over replicas, lands the sharded grads) when its turn
        comes."""
        # One call each: for TP, turning a Partial grad into its placements communicates.
        to_reduce = [(p, p.grad_to_reduce()) for p in self.fsdp_params]
        if self.reduce_scatter_unused_params:
            # Every rank must issue the same collective even if some rank left a
            # parameter unused this step (conditional compute, MoE): send zeros.
            to_reduce = [
                (p, p.zero_grad_to_reduce() if g is None and p.requires_grad else g)
                for p, g in to_reduce
            ]
        with_grad = [p for p, grad in to_reduce if grad is not None]
        if not with_grad:
            return
        # Wait for the oldest in flight before this group's buffer exists: at most
        # max_in_flight_reduce_scatters of them at once (see [Note: reduce-scatters in
        # flight]).
        ctx.make_room_for_reduce_scatter()
        reduce_dtype = with_grad[0].reduce_dtype
        plan = ReductionPlan.choose(
            self.reduce_scatter_group,
            self.mesh_info.replicate_group if self.mesh_info.is_hsdp else None,
            self.mesh_info.device,
            # fp16 could overflow while the collective sums: it pre-divides instead.
            prefer_average=self.gradient_divide_factor is None
            and not self.force_sum_reduction
            and reduce_dtype in _NO_OVERFLOW_RISK,
            custom=self.custom_reduce_scatter,
        )
        # Read once: the whole reduction of this backward follows one policy.
        policy = self.comm_precision
        is_quantized = [self._quantizes(p, policy, replicate_leg=False) for p in with_grad]
        if policy is not None and policy.reduce_scatter is not None:
            # Quantized legs sum in fp32 after decoding: no collective averages.
            plan = dataclasses.replace(
                plan,
                use_all_to_all=plan.use_all_to_all or any(is_quantized),
                average_in_reduce_scatter=plan.average_in_reduce_scatter and not any(is_quantized),
                average_in_all_reduce=False,
            )
        grads = [grad.to(reduce_dtype) for _, grad in to_reduce if grad is not None]
        if ctx.check is not None and ctx.check.applies_to("reduce_scatter"):
            ctx.check.before(
                self.reduce_scatter_group,
                self.mesh_info.device,
                fqn,
                "backward",
                "reduce_scatter",
                sum(g.numel() for g in grads) * reduce_dtype.itemsize,
                grad_names=[p.fqn for p in with_grad],
                first_nonfinite=_first_nonfinite(grads) if ctx.check.finite_grads else -1,
            )
        pre_divisor, post_divisor = self._divisors(plan, reduce_dtype)
        if pre_divisor != 1.0:
            grads = torch._foreach_div(grads, pre_divisor)
        issued_s, issued_event = time.perf_counter(), self._timing_event()
        if any(is_quantized):
            assert policy is not None and policy.reduce_scatter is not None
            result = quantized_reduce_scatter(
                grads,
                is_quantized,
                reduce_dtype,
                self.reduce_scatter_group,
                plan,
                policy.reduce_scatter,
                policy.block_size,
                self._error_feedback_residuals(with_grad, is_quantized)
                if policy.error_feedback
                else None,
            )
        else:
            result = reduce_scatter(
                grads, reduce_dtype, self.reduce_scatter_group, plan, async_op=True
            )
        # The grads now live in the reduce-scatter input: free the unsharded ones.
        for fsdp_param in with_grad:
            fsdp_param.clear_unsharded_grad()
        # HSDP: the all-reduce stream reads what compute wrote up to here (the
        # reduce-scatter input, which is its output at shard size 1; earlier partial
        # sums) and waits for this event first: a Work orders only the collective.
        written = ctx.streams.record_compute() if self.mesh_info.is_hsdp else None
        issued = IssuedReduceScatter(
            result, with_grad, post_divisor, policy, fqn, issued_s, issued_event, written
        )
        ctx.enqueue_reduce_scatter(
            lambda: self._finish(issued, ctx),
            lambda: result.work.wait() if result.work is not None else None,
        )

    def _error_feedback_residuals(
        self, params: list[FSDPParam], is_quantized: list[bool]
    ) -> list[torch.Tensor | None]:
        world_size = self.mesh_info.shard_size
        residuals: list[torch.Tensor | None] = []
        for fsdp_param, quantized in zip(params, is_quantized, strict=True):
            if not quantized:
                residuals.append(None)
                continue
            if fsdp_param not in self._residuals:
                # Row r: the error of this rank's contribution to rank r's shard.
                self._residuals[fsdp_param] = torch.zeros(
                    (world_size, fsdp_param.padded_shard_numel),
                    dtype=torch.float32,
                    device=fsdp_param.compute_device,
                )
            residuals.append(self._residuals[fsdp_param])
        return residuals

    def _divisors(self, plan: ReductionPlan, reduce_dtype: torch.dtype) -> tuple[float, float]:
        """(before, after) the reduction: the gradient average over every data-parallel
        rank, or ``set_gradient_divide_factor``'s factor, less the axes whose collective
        averages. Other dtypes than fp32/bf16 (fp16's range is small) split it around the
        sum, about sqrt each side, so the sum cannot overflow: torch's power-of-two split,
        so the rounding is torch's too."""
        divisor = self.gradient_divide_factor or float(
            (1 if plan.average_in_reduce_scatter else self.mesh_info.shard_size)
            * (1 if plan.average_in_all_reduce else self.mesh_info.replicate_size)
        )
        if divisor == 1.0 or reduce_dtype in _NO_OVERFLOW_RISK:
            return 1.0, divisor
        pre_divisor = 1
        while divisor % pre_divisor == 0 and divisor / pre_divisor > pre_divisor:
            pre_divisor *= 2
        return float(pre_divisor), divisor / pre_divisor

    def _finish(self, issued: "IssuedReduceScatter", ctx: CommContext) -> None:
        if self.mesh_info.is_hsdp and self.requires_all_reduce:
            self._issue_all_reduce(issued, ctx)
            return
        self._wait_reduce_scatter(issued)  # on an accelerator, compute waits
        reduced = _finish_any_reduce_scatter(issued.result)  # (sum of padded chunk numels,)
        if not self.mesh_info.is_hsdp:
            self._land(issued.params, reduced, issued.post_divisor, ctx.streams)
            return
        for fsdp_param, chunk in zip(
            issued.params, self._split(reduced, issued.params), strict=True
        ):
            fsdp_param.accumulate_partial_grad(chunk)

    def _wait_reduce_scatter(self, issued: "IssuedReduceScatter") -> None:
        result = issued.result
        if result.work is None and self.mesh_info.shard_size == 1:
            return  # nothing was issued (one rank)
        wait_s, waited_event = time.perf_counter(), self._timing_event()
        if result.work is not None:
            result.work.wait()
        self._record_comm(
            "reduce_scatter",
            result.input_nbytes,
            issued.issued_s,
            wait_s,
            phase="backward",
            device=DeviceTiming.of(issued.issued_event, waited_event, self._timing_event),
        )

    def _issue_all_reduce(self, issued: "IssuedReduceScatter", ctx: CommContext) -> None:
        """HSDP: once the reduce-scatter is done, issue the all-reduce over replicas on
        its own stream; it is in flight while backward goes on, and the gradients land
        when the scheduler finishes it (the bounded queue, or the end of backward)."""
        streams = ctx.streams
        with streams.on(StreamRole.ALL_REDUCE):
            # The all-reduce stream waits for the reduce-scatter and what compute wrote
            # before it, not for the compute queued since.
            streams.wait_for_event(StreamRole.ALL_REDUCE, issued.written_event)
            self._wait_reduce_scatter(issued)
            reduced = _finish_any_reduce_scatter(issued.result)
            pending = self._all_reduce_over_replicas(
                dict(zip(issued.params, self._split(reduced, issued.params), strict=True)),
                average=issued.result.plan.average_in_all_reduce,
                policy=issued.policy,
                check=ctx.check,
                fqn=issued.fqn,
            )
        # Compute frees what the all-reduce stream read: the reduce-scatter's buffers and
        # the partial sums of micro-batches without all-reduce.
        streams.join(StreamRole.ALL_REDUCE)
        ctx.enqueue_all_reduce(
            lambda: self._land_all_reduced(pending, issued.post_divisor, streams), pending.wait
        )

    def _land_all_reduced(
        self, pending: "ReplicaAllReduce", post_divisor: float, streams: CommStreams
    ) -> None:
        params, reduced = self._finish_all_reduce(pending)  # read on the compute stream
        # The all-reduce stream may reuse its buffers once compute has read them.
        streams.wait_for_compute(StreamRole.ALL_REDUCE)
        self._land(params, reduced, post_divisor, streams)

    def _land(
        self,
        params: list[FSDPParam],
        reduced: torch.Tensor,
        post_divisor: float,
        streams: CommStreams,
    ) -> None:
        """Divide once and run the user's hook (in torch's order), and land each param's
        chunk on its ``.grad``
        (CPU offload: copied to the host, asynchronously where nothing reads it there
        before the end of backward, which then waits for `offload_event`)."""
        # The hook sees what torch's sees: torch divides inside the collective (AVG,
        # PREMUL_SUM) for fp32/bf16 unless sums are forced, and after the hook otherwise.
        divided_in_collective = (
            not self.force_sum_reduction and reduced.dtype in _NO_OVERFLOW_RISK
        )
        if post_divisor != 1.0 and divided_in_collective:
            reduced.div_(post_divisor)
        if self.all_reduce_hook is not None:
            with streams.on_user_stream(self.all_reduce_hook_stream):
                self.all_reduce_hook(reduced)
        if post_divisor != 1.0 and not divided_in_collective:
            reduced.div_(post_divisor)
        to_host = streams.copy_to_host if self.offload else None
        copying = [
            fsdp_param.accumulate_sharded_grad(chunk, to_host)
            for fsdp_param, chunk in zip(params, self._split(reduced, params), strict=True)
        ]
        if any(copying):
            self.offload_event = streams.record_compute()

    def wait_for_offloaded_grads(self, streams: CommStreams) -> None:
        """Block the host until this backward's asynchronous grad copies have landed."""
        event, self.offload_event = self.offload_event, None
        streams.wait_on_host(event)

    @staticmethod
    def _split(reduced: torch.Tensor, params: list[FSDPParam]) -> tuple[torch.Tensor, ...]:
        return reduced.split([p.padded_shard_numel for p in params])

    def _all_reduce_over_replicas(
        self,
        chunks: dict[FSDPParam, torch.Tensor],
        average: bool,
        policy: CommPrecisionPolicy | None,
        check: CollectiveCheck | None,
        fqn: str,
    ) -> "ReplicaAllReduce":
        """HSDP: issue the reduction of the shard-reduced chunks over the replicate axis
        (one all-reduce, plus the quantized leg's all-to-all if a policy quantizes it),
        adding the partial sums that micro-batches without all-reduce left."""
        params = [p for p in self.fsdp_params if p in chunks or p.partial_reduced_grad is not None]
        parts = []
        for fsdp_param in params:
            chunk, partial = chunks.get(fsdp_param), fsdp_param.partial_reduced_grad
            parts.append(
                chunk if partial is None else partial if chunk is None else partial + chunk
            )
            fsdp_param.partial_reduced_grad = None
        if check is not None and check.applies_to("all_reduce"):
            check.before(
                self.mesh_info.replicate_group,
                self.mesh_info.device,
                fqn,
                "backward",
                "all_reduce",
                sum(t.nbytes for t in parts),
            )
        issued_s, issued_event = time.perf_counter(), self._timing_event()
        is_quantized = [self._quantizes(p, policy, replicate_leg=True) for p in params]
        exact = [t for t, q in zip(parts, is_quantized, strict=True) if not q]
        quantized = [t for t, q in zip(parts, is_quantized, strict=True) if q]
        exact_flat, exact_work, quantized_result = None, None, None
        nbytes = 0
        if exact:
            exact_flat = torch.cat(exact)  # (exact padded chunk numels,)
            exact_work = all_reduce(exact_flat, self.mesh_info.replicate_group, average)
            nbytes += exact_flat.nbytes
        if quantized:
            assert policy is not None and policy.reduce_scatter is not None
            quantized_result = quantized_all_reduce(
                quantized, self.mesh_info.replicate_group, policy.reduce_scatter, policy.block_size
            )
            nbytes += quantized_result.nbytes
        return ReplicaAllReduce(
            params, is_quantized, [t.numel() for t in exact], exact_flat, exact_work,
            quantized_result, issued_s, issued_event, nbytes,
        )  # fmt: skip

    def _finish_all_reduce(
        self, pending: "ReplicaAllReduce"
    ) -> tuple[list[FSDPParam], torch.Tensor]:
        """Wait for the replicate-axis reduction; the params and their reduced chunks, one
        1-D buffer in the params' order."""
        wait_s, waited_event = time.perf_counter(), self._timing_event()
        exact: list[torch.Tensor] = []
        if pending.exact_flat is not None:
            if pending.exact_work is not None:
                pending.exact_work.wait()
            exact = list(pending.exact_flat.split(pending.exact_numels))
        quantized: list[torch.Tensor] = []
        if pending.quantized is not None:
            quantized = finish_quantized_all_reduce(pending.quantized)
        self._record_comm(
            "all_reduce",
            pending.nbytes,
            pending.issued_s,
            wait_s,
            phase="backward",
            group_size=self.mesh_info.replicate_size,
            device=DeviceTiming.of(pending.issued_event, waited_event, self._timing_event),
        )
        exact_iter, quantized_iter = iter(exact), iter(quantized)
        flat = torch.cat(
            [next(quantized_iter) if q else next(exact_iter) for q in pending.is_quantized]
        )  # (sum of padded chunk numels,)
        return pending.params, flat


@dataclasses.dataclass(frozen=True)
class IssuedReduceScatter:
    """One group's reduce-scatter in flight, and what finishing it needs."""

    result: ReduceScatterResult | QuantizedReduceScatterResult
    params: list[FSDPParam]  # those with a gradient, in the reduced buffer's order
    post_divisor: float
    policy: CommPrecisionPolicy | None  # read once: the whole reduction follows it
    fqn: str  # the group's, for the checks' messages
    issued_s: float
    issued_event: object | None  # device timing, when tracing on an accelerator
    written_event: object | None  # HSDP: compute's writes before the issue (see there)


@dataclasses.dataclass(frozen=True)
class ReplicaAllReduce:
    """HSDP's replicate-axis reduction of one group's gradients, in flight."""

    params: list[FSDPParam]  # in the reduced buffer's order
    is_quantized: list[bool]  # per param: on the quantized leg
    exact_numels: list[int]  # per exact param, its chunk's elements
    exact_flat: torch.Tensor | None  # the exact params' chunks, all-reduced in place
    exact_work: dist.Work | None
    quantized: QuantizedAllReduceResult | None
    issued_s: float
    issued_event: object | None  # device timing, when tracing on an accelerator
    nbytes: int  # bytes this rank sends

    def wait(self) -> None:
        """Wait only (after an exception): the buffers must outlive the collectives."""
        if self.exact_work is not None:
            self.exact_work.wait()
        if self.quantized is not None and self.quantized.work is not None:
            self.quantized.work.wait()


def _finish_any_reduce_scatter(
    result: ReduceScatterResult | QuantizedReduceScatterResult,
) -> torch.Tensor:
    """This rank's reduced chunk of every grad, (sum of padded chunk numels,)."""
    if isinstance(result, QuantizedReduceScatterResult):
        return finish_quantized_reduce_scatter(result)
    return finish_reduce_scatter(result)


def _first_nonfinite(grads: list[torch.Tensor]) -> int:
    """The index of the first gradient holding a NaN or Inf, -1 if none: one fused
    max-abs per gradient (NaN propagates through it; finite values cannot overflow)
    and one host sync for the whole group."""
    max_abs = torch.stack(torch._foreach_norm(grads, float("inf")))  # (len(grads),)
    bad = (~max_abs.isfinite()).nonzero()
    return int(bad[0]) if bad.numel() else -1
