"""Muon on fully-sharded 2-D parameters: Newton-Schulz on whole matrices at owner ranks.

``Muon`` is ``torch.optim.Muon`` (same hyper-parameters, defaults, math and state
dict) for params that are DTensors sharded over one mesh axis, as ``fully_shard``
leaves them (``Shard(0)``; HSDP's ``(Replicate(), Shard(0))``). torch's Muon runs its
Newton-Schulz iteration on those DTensors, so every matmul of every iteration
redistributes, and partial sums are added in bf16. Here the momentum update stays
element-wise on the local shards, and the orthogonalization runs on whole matrices,
each at one owner rank of the shard group, with two all-to-alls per step and shard
group (see [Note: owner exchange] in owner.py).

[Note: Muon numerics] Everything torch.optim.Muon computes element-wise (the momentum
``lerp``, Nesterov's ``lerp``, weight decay, the final ``add_``) is computed here on the
local chunks with the same ops, and the owner runs the same Newton-Schulz ops on the
same whole matrix in the same dtype. Newton-Schulz starts by casting its input to bf16,
so the chunks are cast before they travel (the cast is element-wise: same values, half
the bytes), and its bf16 result travels back as it is. So, from the same gradients, a
step gives the same bits as torch.optim.Muon on the unsharded params (a test checks
this over 20 steps). From gradients that differ by fp32 rounding (a sharded backward
sums in another order), bf16 rounding of the update can flip in rare elements, which
moves a parameter by at most about ``lr * adjust * ulp_bf16(update)``.
"""

import math
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from .owner import ShardedMatrix, gather_to_owners, plan_owners, scatter_from_owners

# torch.optim.Muon's defaults (torch/optim/_muon.py, from Keller Jordan's Muon).
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5

_ADJUST_LR_FNS = ("original", "match_rms_adamw")


def zeropower_via_newtonschulz(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Orthogonalize a 2-D ``update`` with ``ns_steps`` quintic Newton-Schulz iterations.

    The same ops as torch.optim.Muon's ``_zeropower_via_newtonschulz``, in bf16; the one
    difference is that a bf16 input is copied rather than normalized in place.

    Returns:
        A bf16 tensor of ``update``'s shape, roughly ``U V^T`` of its SVD ``U S V^T``.

    Raises:
        ValueError: as torch's, for ``ns_steps >= 100``, a non-2-D input, or not
            exactly three coefficients.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(update.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    # copy=True: a bf16 input (torch's Muon passes the momentum buffer itself when
    # nesterov=False) must not be divided in place below.
    ortho = update.to(torch.bfloat16, copy=True)
    is_tall = update.size(0) > update.size(1)
    if is_tall:
        ortho = ortho.T  # (min, max): the Gram matrix below is the smaller one
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T  # (min, min)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if is_tall else ortho


def adjust_lr(lr: float | Tensor, adjust_lr_fn: str | None, shape: torch.Size) -> float | Tensor:
    """torch.optim.Muon's learning rate for a matrix of ``shape`` (the whole shape)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def newton_schulz_cost(shape: torch.Size, ns_steps: int) -> float:
    """Multiply-adds of ``zeropower_via_newtonschulz`` on ``shape``: the owner load."""
    small, large = sorted(shape)
    # Per iteration: Gram (small^2 * large), its square (small^3), times X (small^2 * large).
    return float(ns_steps * (2 * small * small * large + small**3))


@dataclass(frozen=True)
class _ShardLayout:
    """How a DTensor param is split over its one shard axis (see ``_shard_layout``)."""

    group: dist.ProcessGroup
    group_size: int
    group_rank: int
    matrix: ShardedMatrix


@dataclass(frozen=True)
class _MatrixStep:
    """One param's step between the momentum update and the final ``add_``."""

    param: Tensor
    update: Tensor
    """The local chunk (or the whole matrix) to orthogonalize: Nesterov's or the buffer."""
    group: MutableMapping[str, Any]
    layout: _ShardLayout | None
    """None: the local tensor is the whole matrix (plain tensor, replicated, or a
    shard group of one rank)."""


class Muon(Optimizer):
    r"""torch.optim.Muon for fully-sharded 2-D parameters.

    A drop-in for ``torch.optim.Muon``: the same arguments, defaults, update and state
    (``state[p]["momentum_buffer"]``, shaped and placed like ``p``), so state dicts,
    ``torch.distributed.checkpoint`` and ``dtensor_fsdp.checkpoint`` work as with
    torch's, and a run can switch between them. What differs is where Newton-Schulz
    runs: each matrix sharded over a mesh axis is orthogonalized whole, on one owner
    rank of that axis (largest first onto the least-loaded rank), with one all-to-all
    to assemble the matrices on their owners and one to return the chunks, per step and
    per shard group (all matrices sharded over the same process group form one group);
    see [Note: owner exchange] in ``dtensor_fsdp/optim/owner.py``.

    Supported params:

    - DTensors with one ``Shard(0)`` or ``Shard(1)`` mesh axis and ``Replicate()`` on the
      others: FSDP (``fully_shard``, ours or torch's) and HSDP, where owners are ranks
      of the shard axis and every replica computes the same update (its gradients are
      already all-reduced).
    - Plain tensors and fully replicated DTensors: orthogonalized locally, like torch.

    Tensor parallelism is not supported: a DTensor sharded over more than one mesh axis
    (FSDP + TP's ``(Shard(0), Shard(1))``, ``_StridedShard``) raises
    ``NotImplementedError`` at construction, naming the parameter; give such params
    to ``torch.optim.Muon`` (which runs Newton-Schulz on the DTensors) instead.

    Muon is for the 2-D weights of hidden layers; embeddings, the output head, norms
    and biases belong to an element-wise optimizer such as AdamW
    (``split_muon_params`` does the split).

    Args:
        params: iterable of parameters or named parameters, or of dicts defining
            parameter groups; 2-D only.
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``
            (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: use Nesterov momentum (default: True).
        ns_coefficients: coefficients (a, b, c) of the quintic Newton-Schulz polynomial
            (default: (3.4445, -4.7750, 2.0315)).
        eps: floor of the norm the input is divided by (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: ``None`` or ``"original"`` (``lr * sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``0.2 * lr * sqrt(max(rows, cols))``, which lets Muon
            reuse AdamW's learning rate and weight decay) (default: None).

    Raises:
        ValueError: as torch's: a negative lr, momentum or weight decay, an unknown
            ``adjust_lr_fn``, a parameter that is not 2-D (naming it when named
            parameters are given).
        NotImplementedError: a DTensor parameter sharded over more than one mesh axis
            (tensor parallelism), or with a placement other than ``Shard`` and
            ``Replicate``.

    Example::

        >>> muon_params, adamw_params = split_muon_params(model)  # after fully_shard
        >>> muon = Muon(muon_params, lr=0.02, momentum=0.95)
        >>> adamw = torch.optim.AdamW(adamw_params, lr=3e-4, weight_decay=0.01)
        >>> loss_fn(model(x), y).backward()
        >>> muon.step(); adamw.step()
        >>> muon.zero_grad(); adamw.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        # torch.optim.Muon's checks and messages.
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, after checking every parameter (nothing is added
        if one is refused)."""
        params = param_group["params"]
        if isinstance(params, set):
            super().add_param_group(param_group)  # torch's TypeError: sets are unordered
        entries = [params] if isinstance(params, Tensor) else list(params)
        for index, entry in enumerate(entries):
            name, param = entry if isinstance(entry, tuple) else (None, entry)
            where = repr(name) if name is not None else f"#{index} of its param group"
            _validate_param(param, where)
        super().add_param_group({**param_group, "params": entries})

    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step: every shard group issues two all-to-alls.

        Every rank of a shard group must call it (the params with a gradient must be the
        same on every rank, as after a ``fully_shard`` backward).

        Args:
            closure: reevaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps = [step for group in self.param_groups for step in self._momentum_steps(group)]
        updates = _orthogonalize(steps)
        for step, update in zip(steps, updates, strict=True):
            _apply_update(step, update)
        return loss

    def _momentum_steps(self, group: MutableMapping[str, Any]) -> list[_MatrixStep]:
        """The element-wise first half of torch's step, on local chunks."""
        momentum = group["momentum"]
        steps = []
        for param in group["params"]:
            if param.grad is None:
                continue
            if torch.is_complex(param):
                raise RuntimeError("Muon does not support complex parameters")
            if param.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    param.grad, memory_format=torch.preserve_format
                )
            _check_grad_placements(param)
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            steps.append(_MatrixStep(param, update, group, _shard_layout(param)))
        return steps


def _orthogonalize(steps: Sequence[_MatrixStep]) -> list[Tensor]:
    """Newton-Schulz of every step's update: locally for whole matrices, at owner ranks
    for sharded ones (one exchange per shard group). This rank's chunk of each, bf16."""
    results: list[Tensor | None] = [None] * len(steps)
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    for index, step in enumerate(steps):
        if step.layout is None:
            results[index] = _newton_schulz(step.update, step.group)
        else:
            by_group.setdefault(step.layout.group, []).append(index)
    for group, indices in by_group.items():
        chunks = _exchange([steps[i] for i in indices], group)
        for index, chunk in zip(indices, chunks, strict=True):
            results[index] = chunk
    return results


def _exchange(steps: Sequence[_MatrixStep], group: dist.ProcessGroup) -> list[Tensor]:
    """One shard group's steps through [Note: owner exchange]: this rank's result chunks."""
    layout = steps[0].layout
    plan = plan_owners(
        [step.layout.matrix for step in steps],
        [newton_schulz_cost(step.layout.matrix.shape, step.group["ns_steps"]) for step in steps],
        layout.group_size,
        layout.group_rank,
    )
    # Newton-Schulz's first op is the bf16 cast: cast before the wire ([Note: Muon numerics]).
    chunks = [step.update.bfloat16() for step in steps]
    wholes = gather_to_owners(plan, chunks, group)
    results = {i: _newton_schulz(whole, steps[i].group) for i, whole in wholes.items()}
    return scatter_from_owners(plan, results, group, like=chunks[0])


def _newton_schulz(update: Tensor, group: MutableMapping[str, Any]) -> Tensor:
    return zeropower_via_newtonschulz(
        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )


def _apply_update(step: _MatrixStep, update: Tensor) -> None:
    """torch's weight decay and update, on the local chunk; ``update`` is that chunk's."""
    group = step.group
    lr = _to_scalar(group["lr"])
    adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], step.param.shape)  # whole shape
    param = _local(step.param)
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(update, alpha=-adjusted_lr)


def _to_scalar(value: float | Tensor) -> float | Tensor:
    """torch.optim's ``_to_scalar``: a 1-element tensor becomes 0-D, a number stays."""
    if isinstance(value, Tensor) and value.dim() != 0:
        return value.squeeze()
    return value


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ---------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------


def _validate_param(param: Tensor, where: str) -> None:
    if param.ndim != 2:
        raise ValueError(
            "Muon only supports 2D parameters whereas we found a parameter with size: "
            f"{param.size()} (parameter {where}). Give Muon the hidden layers' weight "
            "matrices and the rest (norms, biases, embeddings, output head) to AdamW: "
            "dtensor_fsdp.optim.split_muon_params(model) does the split."
        )
    if not isinstance(param, DTensor):
        return
    placements = tuple(param.placements)
    unsupported = [p for p in placements if type(p) not in (Shard, Replicate)]
    shard_axes = [axis for axis, p in enumerate(placements) if type(p) is Shard]
    if unsupported or len(shard_axes) > 1:
        raise NotImplementedError(
            f"dtensor_fsdp.optim.Muon: parameter {where} has placements {placements} on "
            f"mesh {param.device_mesh}; only one Shard mesh axis (FSDP, HSDP) and "
            "Replicate are supported, not tensor parallelism. Give it to "
            "torch.optim.Muon, which runs Newton-Schulz on DTensors, instead."
        )
    if shard_axes:
        _check_rank_order(param, shard_axes[0], where)


def _check_rank_order(param: DTensor, axis: int, where: str) -> None:
    """Chunk ``c`` of ``Shard`` lives at mesh coordinate ``c`` of the axis; the all-to-all
    addresses group ranks. They agree for every mesh built from ordered ranks."""
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return  # this rank is not in the mesh: nothing to step
    index = tuple(slice(None) if a == axis else c for a, c in enumerate(coordinate))
    ranks = mesh.mesh[index].tolist()  # global ranks along the axis, in coordinate order
    group = mesh.get_group(axis)
    if [dist.get_group_rank(group, r) for r in ranks] != list(range(len(ranks))):
        raise NotImplementedError(
            f"dtensor_fsdp.optim.Muon: parameter {where}: mesh axis {axis} of "
            f"{mesh} lists its ranks out of process-group order; build the mesh from "
            "ranks in increasing order along each axis."
        )


def _shard_layout(param: Tensor) -> _ShardLayout | None:
    """The shard axis's group and chunks, or None if this rank holds the whole matrix."""
    if not isinstance(param, DTensor):
        return None
    for axis, placement in enumerate(param.placements):
        if type(placement) is Shard:
            mesh = param.device_mesh
            if mesh.size(axis) == 1:
                return None
            group = mesh.get_group(axis)
            return _ShardLayout(
                group=group,
                group_size=mesh.size(axis),
                group_rank=dist.get_rank(group),
                matrix=ShardedMatrix(param.shape, placement.dim),
            )
    return None


def _check_grad_placements(param: Tensor) -> None:
    if isinstance(param, DTensor) and (
        not isinstance(param.grad, DTensor) or param.grad.placements != param.placements
    ):
        got = param.grad.placements if isinstance(param.grad, DTensor) else "a plain tensor"
        raise ValueError(
            f"dtensor_fsdp.optim.Muon: a parameter with placements {param.placements} has "
            f"a gradient with {got}; the gradient must be placed like its parameter."
        )


# ---------------------------------------------------------------------------
# The recipe: Muon for hidden matrices, an element-wise optimizer for the rest
# ---------------------------------------------------------------------------


def split_muon_params(
    model: nn.Module, *, exclude: Iterable[str] = ("output", "lm_head")
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split ``model``'s trainable parameters into Muon's and AdamW's, per Muon's recipe.

    Muon gets every 2-D parameter except those of ``nn.Embedding`` modules (including
    an output head tied to one) and those of modules whose name (the last part of
    their FQN) is in ``exclude``: by default the output head as torchtitan
    (``output``) and Hugging Face (``lm_head``) name it. Everything else (embeddings,
    the output head, norms, biases, any non-2-D parameter) goes to the second list,
    for an element-wise optimizer. Call it on the model after ``fully_shard``, whose
    parameters the optimizers must hold; each parameter appears once, in
    ``named_parameters`` order.

    Args:
        model: the model.
        exclude: module names whose 2-D parameters go to the element-wise optimizer.

    Returns:
        ``(muon_params, other_params)``.
    """
    exclude = frozenset(exclude)
    not_muon = set()
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Embedding) or fqn.rsplit(".", 1)[-1] in exclude:
            not_muon.update(id(p) for p in module.parameters(recurse=False))
    muon_params, other_params = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        is_muon = param.ndim == 2 and id(param) not in not_muon
        (muon_params if is_muon else other_params).append(param)
    return muon_params, other_params
