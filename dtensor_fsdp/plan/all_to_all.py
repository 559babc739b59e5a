"""``plan(backend="gloo")``: ours reduce-scatters on gloo by an all-to-all plus a local
sum (gloo's ``reduce_scatter_tensor`` is an all-reduce, twice the traffic). The plan runs
on torch's fake process group, where ours would pick ``reduce_scatter_tensor``, so it
installs this reduce-scatter through the public ``FSDPModule.set_custom_reduce_scatter``:
the same collective and, on the simulated memory, the same buffers alive at the same
moments as ours on gloo (``collectives.reduce_scatter`` and ``finish_reduce_scatter``):

1. the issue: the input and a receive buffer as large as it (the output, allocated
   before, gives its storage back first);
2. the wait: the input's storage is freed (nothing reads it after the collective), then
   the output gets its storage and the sum of the W received chunks;
3. the receive buffer lives as long as FSDP holds the collective's ``Work``, as ours
   keeps its receive buffer as long as the collective's result.
"""

import torch
import torch.distributed as dist

from ..api import ReduceOp, ReduceScatter


class AllToAllReduceScatter(ReduceScatter):
    """A sum (or average) reduce-scatter by ``all_to_all_single`` and a local sum, whose
    buffers are alive when those of ours on gloo are (see the module docstring)."""

    def allocate(
        self, size: list[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"AllToAllReduceScatter sums or averages, got {op}")
        # The sum's output gets its storage back at the wait: ours allocates it only
        # after freeing the input (it holds nothing yet; free while the receive buffer
        # is not allocated, so the peak is never both).
        output_tensor.untyped_storage().resize_(0)
        received = torch.empty_like(input_tensor)  # (W * shard_numel,): chunk r from rank r
        work = dist.all_to_all_single(received, input_tensor, group=group, async_op=async_op)
        average = op == dist.ReduceOp.AVG  # ours passes SUM; torch's FSDP2 AVG on gloo
        summed = _SumOnWait(work, input_tensor, received, output_tensor, average)
        if async_op:
            return summed
        summed.wait()
        return None


class _SumOnWait(dist.Work):
    """The all-to-all's ``Work``; waiting it also frees the input and sums the chunks
    into the output (once)."""

    def __init__(
        self,
        work: dist.Work | None,
        input_tensor: torch.Tensor,
        received: torch.Tensor,
        output: torch.Tensor,
        average: bool,
    ) -> None:
        super().__init__()
        self._work = work
        self._input: torch.Tensor | None = input_tensor
        self._received = received  # kept: ours keeps its receive buffer this long
        self._output = output
        self._average = average

    def wait(self, timeout: object = None) -> bool:
        if self._work is not None:
            self._work.wait()
        if self._input is None:
            return True  # summed already
        self._input.untyped_storage().resize_(0)
        self._input = None
        output = self._output
        output.untyped_storage().resize_(output.numel() * output.element_size())
        received = self._received.view(-1, output.numel())  # (W, shard_numel)
        torch.sum(received, dim=0, out=output)
        if self._average:
            output.div_(received.shape[0])
        return True
