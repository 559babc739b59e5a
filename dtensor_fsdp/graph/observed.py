"""The observers see graph mode: each compiled graph's launch, with its collectives.

The eager runtime tells its observers (runtime/observer.py: the flight recorder and its
watchdog, the divergence check, ``CommTrace``) about every collective at its issue and
wait. Graph mode's collectives are ops of compiled graphs, waited inside them; what
the host sees is each graph's launch. So when a graph is compiled, the collectives it
holds are read off it in order (`collectives_of`: kind, process group, bytes, group
FQN where the node carries it), and at every launch `ObservedGraph` describes them to
the observers before the graph runs (each observer checks and records them, as at
eager issues: the peers can read the sequence), marks them waited inside the graph
(the watchdog's poller follows a launch that does not return, as it follows device
collectives), and, if the graph raises (a peer died: gloo closes its connections; or
sizes mismatched), hands the error to them, so that the survivors end in the same
named error as in eager mode (``CollectiveMismatchError``).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from ..runtime.observer import (
    Collective,
    CollectiveWatch,
    GraphLaunch,
    Observers,
    check_collective,
    watch_collective,
)
from ..runtime.streams import CommStreams

# Functional collectives (and graph mode's strategy ops) by op name, as observers name
# them; bucketing emits ``_out`` variants of the same ops.
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_reduce": "all_reduce",
    "strategy_all_gather": "all_gather",
    "strategy_reduce_scatter": "reduce_scatter",
}
GROUP_ANNOTATION = "dtensor_fsdp_group"  # a gather's nodes carry its group's FQN


@dataclass(frozen=True)
class GraphCollective:
    """One collective of a compiled graph, as read off its node."""

    kind: str
    group_name: str
    nbytes: int  # what this rank contributes
    fqn: str  # the group's, or "graph" where the node does not say (a merged bucket)


def collectives_of(gm: fx.GraphModule) -> tuple[GraphCollective, ...]:
    """The collectives of ``gm``'s graph, in its order."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", None)
        name = getattr(node.target, "_opname", "").removesuffix("_out")
        if namespace not in ("_c10d_functional", "dtensor_fsdp") or name not in _KINDS:
            continue
        custom = node.meta.get("custom") or {}
        fqn = custom.get(GROUP_ANNOTATION, "graph")
        # Every one of these ops takes its process group's name last.
        found.append(GraphCollective(_KINDS[name], node.args[-1], _nbytes(node.args[0]), fqn))
    return tuple(found)


def _nbytes(value: Any) -> int:
    values = value if isinstance(value, (list, tuple)) else [value]
    total = 0
    for arg in values:
        tensor = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


# What a launch reads when it starts: the root's observers, streams and device.
ObserversOf = Callable[[], tuple[Observers, CommStreams, torch.device]]


class ObservedGraph:
    """A compiled graph (a boxed callable) whose launches its root's observers see."""

    def __init__(
        self,
        compiled: Callable[[list[Any]], Any],
        collectives: Sequence[GraphCollective],
        phase: str,
        observers_of: ObserversOf,
    ) -> None:
        self.compiled = compiled
        self.collectives = tuple(collectives)
        self.phase = phase
        self.observers_of = observers_of
        self._described: tuple[Collective, ...] | None = None
        # AOT autograd calls it with one list of inputs. An instance attribute: the
        # wrappers around a backward graph (dynamo's disable) copy ``__dict__``.
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        observers, streams, device = self.observers_of()
        if not observers or not self.collectives:
            return self.compiled(args)
        described = self._describe(streams, device)
        watches: list[tuple[CollectiveWatch, int]] = []
        for collective in described:
            check_collective(observers, collective)
            watches.extend((w, collective.nbytes) for w in watch_collective(observers, collective))
        launch = GraphLaunch()
        for watch, _ in watches:
            watch.waiting()
            watch.in_graph(launch)
        try:
            result = self.compiled(args)
        except RuntimeError as error:
            launch.returned = True
            for watch, _ in watches:
                watch.failed(error)  # may raise the observers' clearer error
            raise
        launch.returned = True
        for watch, nbytes in watches:
            watch.waited(nbytes, self.phase)
        return result

    def _describe(self, streams: CommStreams, device: torch.device) -> tuple[Collective, ...]:
        if self._described is None:
            groups = {c.group_name: _resolve_process_group(c.group_name) for c in self.collectives}
            self._described = tuple(
                Collective(
                    c.kind, c.fqn, self.phase, groups[c.group_name],
                    groups[c.group_name].size(), device, c.nbytes, streams,
                )  # fmt: skip
                for c in self.collectives
            )
        return self._described

