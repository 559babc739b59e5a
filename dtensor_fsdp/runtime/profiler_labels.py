"""FSDP's steps as ``torch.profiler`` ranges, named as torch's FSDP2 names them.

[Note: profiler labels]
While a profiler runs, every group's steps show in its traces (and in Perfetto) as
``record_function`` ranges: ``FSDP::<step> (<fqn>)``, without the suffix for the root
(fqn ''), exactly torch FSDP2's ``_with_fqn`` labels, so that a trace of one FSDP reads
like the other's and tools written against torch's labels work on ours unchanged:

- ``pre_forward``: a group's pre-forward; inside it, for the group's own all-gather,
  ``all_gather`` (the copy-in and the issue) and ``all_gather_copy_out`` (the wait and
  the copy-out); a prefetched group's ``all_gather`` is inside ``FSDP::forward_prefetch
  for <fqn>`` (``backward_prefetch`` in backward), issued after its trigger's
  pre-forward (torch's, inside it);
- ``post_forward``: the reshard once the group's forward is over;
- ``pre_backward``: the backward's all-gather (same two ranges inside);
- ``post_backward``: taking the gradients and resharding; inside it
  ``post_backward_reduce``: the reduce-scatter's issue (its wait, and HSDP's
  all-reduce, come with a later group's reduce, or at the end of backward).

A group holds `ProfilerLabels` only while a profiler runs: the root looks at torch's
own flag for that (``torch.autograd.profiler._is_profiler_enabled``, which torch's
compiler reads for the same reason) once per forward, and hands each group of its tree
labels, or takes them back. The verbs test ``group.labels is not None``: without a
profiler a step pays no call for its labels. A profiler started between a forward and
its backward labels the next step.
"""

from torch.profiler import record_function


def label(step: str, fqn: str) -> str:
    """The range of group ``fqn``'s ``step``: torch FSDP2's ``_with_fqn`` label."""
    return f"FSDP::{step} ({fqn})" if fqn else f"FSDP::{step}"


class ProfilerLabels:
    """One group's open ranges (see [Note: profiler labels])."""

    def __init__(self, fqn: str) -> None:
        self._fqn = fqn
        self._open: list[tuple[str, record_function]] = []  # innermost last

    def enter(self, step: str) -> None:
        """Open ``FSDP::<step> (<fqn>)``."""
        self._open_range(step, label(step, self._fqn))

    def enter_prefetch(self, pass_: str) -> None:
        """Open ``FSDP::<pass>_prefetch for <fqn>`` (torch's label of a prefetch of this
        group; ``pass_``: ``"forward"`` or ``"backward"``); closed by
        ``exit("<pass>_prefetch")``."""
        self._open_range(f"{pass_}_prefetch", f"FSDP::{pass_}_prefetch for {self._fqn}")

    def _open_range(self, step: str, name: str) -> None:
        label = record_function(name)
        label.__enter__()
        self._open.append((step, label))

    def exit(self, step: str) -> None:
        """Close ``step``'s range, and any range an exception left open inside it."""
        if all(name != step for name, _ in self._open):
            return
        while self._open:
            name, label = self._open.pop()
            label.__exit__(None, None, None)
            if name == step:
                return

    def close(self) -> None:
        """Close every range still open (the profiler stopped, or the group's labels are
        taken back)."""
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)
