"""All-gather extensions (``fsdp_pre_all_gather``/``fsdp_post_all_gather`` tensor
subclasses) under ``fully_shard``, side by side with torch's ``fully_shard`` on 2 gloo
ranks.

A sharded parameter whose local tensor defines torch FSDP2's all-gather extension
protocol decides what its all-gather carries and what the unsharded parameter is:
torchao's float8 training sends float8 data (a quarter of fp32's bytes) and computes
with a ``Float8TrainingTensor``; NF4 sends its quantized blocks and scalers. Scenarios:

- ``float8``: torchao ``convert_to_float8_training`` with
  ``enable_fsdp_float8_all_gather`` (``emulate=True`` on CPU), an MLP whose float8
  weights share their groups with plain fp32 biases;
- ``float8_precomputed_scale``: plus ``precompute_float8_dynamic_scale_for_fsdp`` after
  every optimizer step (torchtitan's recipe: one all-reduce for all amaxes instead of
  one per weight inside the pre-all-gather);
- ``float8_cpu_offload``: float8 with ``CPUOffloadPolicy`` (the pre-all-gather runs on
  the shard moved to the compute device);
- ``int8_mixed_precision``: torchao's ``int8_mixed_precision_training`` with
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``: its 5-argument pre-all-gather casts
  to ``mp_policy.param_dtype``, so the wire carries bf16;
- ``nf4_lora``: a QLoRA-style layer, a frozen NF4 base weight next to trainable LoRA
  adapters in one group (plain and subclassed parameters mixed);
- ``custom_uneven``: ``_HiLoWeight``, defined here: the 5-argument form with two
  all-gather inputs (a bf16 high part and a bf16 residual) and metadata, on a 65-row
  weight, so rank 1's shard is padded and the inputs must have the padded size;
  ``fsdp_post_all_gather`` returns a plain tensor and refreshes it with ``out=``;
- ``custom_one_arg``: ``_AliasWeight``, the older 1-argument form, whose unsharded
  tensor is a subclass aliasing the all-gather output (it asserts at every ``out=``
  call that it gets the same storage back, as NF4 does).

Each scenario builds the model twice from one seed, shards one copy with ours and one
with torch's (``fully_shard`` per layer, then the root), and trains both ``STEPS``
AdamW steps on the same per-rank batches. Per step it records, for each side: the
loss; the collectives the step issued, counted at the c10d level by ``C10dRecorder``
(``tests/_c10d.py``: the same ruler for both libraries); the type of every unsharded
parameter seen inside forward (a forward pre-hook registered after ``fully_shard`` runs
after its unshard); for the custom subclasses the ``(out is None, number of inputs)``
of each ``fsdp_post_all_gather`` call; then each rank's local gradients and, after the
optimizer step, its local shards.

What must hold:

- losses, local grads and local shards bitwise equal to torch's: both run the same
  pre/post-all-gather code on the same shards, the same local matmuls and the same
  two-rank reductions ([Note: parity tolerances] in ``_parity.py``, item 1);
- per step, the all-gather bytes and counts, and the reduce-scatter (torch; an
  all-to-all in ours on gloo) and all-reduce bytes, equal to torch's;
- all-gather bytes below those of the plain fp32 model (the same architecture without
  the subclass) wherever the format is smaller: a package that ignored the protocol
  would all-gather the fp32 shards (132,608 bytes per step for the float8 MLP, where
  torch sends 34,304);
- the unsharded parameters' types, and the post-all-gather call sequence (``out=``
  reuse from the second unshard on), as torch's.

Misuse is compared with torch in one process on the fake process group: half the
protocol, unpadded inputs on a padded rank, ``reshard_after_forward=int``.
"""

import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from dtensor_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._c10d import C10dRecorder, bytes_of, count_of
from tests._harness import fake_mesh, run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_equal, local_trainable_grad_pairs
from tests._pool import GlooPools

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (float8, int8, NF4)")

WORLD_SIZE = 2
STEPS = 3
BATCH = 8  # rows per rank


# ---------------------------------------------------------------------------
# Two extension subclasses of our own (torchao's WeightWithDynamicFloat8CastTensor
# pattern: a wrapper that keeps its class through FSDP's padding and sharding ops)
# ---------------------------------------------------------------------------

# What FSDP does to a sharded local tensor (pad, slice, copy, move, detach) must keep
# the subclass; every other op (the optimizer's arithmetic) computes on plain tensors.
_OPS_TO_PRESERVE_SUBCLASS = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
}

# Every fsdp_post_all_gather call in this process: (tag, out is None, number of inputs).
# Ours and torch's run one after the other, so each side reads its own slice.
POST_ALL_GATHER_CALLS: list[tuple[str, bool, int]] = []


class _WrapperWeight(torch.Tensor):
    """A plain tensor (``_tensor``) in a wrapper subclass with a ``_tag``."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, tag: str):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, tag: str) -> None:
        self._tensor = tensor
        self._tag = tag

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrapped = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        tag, kind = wrapped[0]._tag, type(wrapped[0])
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _OPS_TO_PRESERVE_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: kind(t, tag), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"tag": self._tag}

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, spec, outer_size, outer_stride):
        return cls(inner_tensors["_tensor"], spec["tag"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor}, tag={self._tag!r})"


class _HiLoWeight(_WrapperWeight):
    """An fp32 weight whose all-gather carries two bf16 tensors, ``high`` and the
    residual ``x - high`` (so ``high + low`` is within bf16 rounding of the residual);
    the unsharded parameter is a plain fp32 tensor that ``out=`` refreshes in place."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # The 5-argument form must return inputs of the padded sharded size: pad the
        # local rows up to ceil(rows / W), as FSDP pads its own shards.
        padded_rows = -(-outer_size[0] // mesh.size())
        local = self._tensor.new_zeros((padded_rows, *self._tensor.shape[1:]))
        local[: self._tensor.size(0)].copy_(self._tensor)
        high = local.to(torch.bfloat16)
        low = (local - high.float()).to(torch.bfloat16)
        return (high, low), (self.dtype, self._tag)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        high, low = all_gather_outputs
        dtype, tag = metadata
        POST_ALL_GATHER_CALLS.append((tag, out is None, len(all_gather_outputs)))
        unsharded = high.to(dtype) + low.to(dtype)  # (padded rows, ...); FSDP trims
        if out is not None:
            # In place into the unsharded param that the last backward's autograd
            # saved: FSDP preserves the version counter of its own all-gather outputs
            # only, so an extension that writes into ``out`` must do so itself.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(unsharded[: out.size(0)])
            return None
        # FSDP frees this storage at reshard and reallocates it before the out= call.
        return unsharded, (unsharded,)


class _UnpaddedHiLoWeight(_HiLoWeight):
    """Misuse: the 5-argument form returning the unpadded local rows."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._tensor.to(torch.bfloat16),), (self.dtype, self._tag)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        raise AssertionError("not reached: the all-gather inputs are rejected")


class _AliasWeight(_WrapperWeight):
    """The 1-argument form: all-gathers its fp32 data unchanged; the unsharded parameter
    is an ``_AliasWeight`` on the all-gather output itself, which FSDP must refill in
    place (the ``out=`` call checks that it gets the same storage)."""

    def fsdp_pre_all_gather(self, mesh):
        return (self._tensor,), (self._tag,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        (tag,) = metadata
        POST_ALL_GATHER_CALLS.append((tag, out is None, len(all_gather_outputs)))
        if out is not None:
            assert isinstance(out, _AliasWeight), type(out)
            assert out._tensor.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            return None
        return _AliasWeight(data, tag), (data,)


class _PreOnlyWeight(_WrapperWeight):
    """Misuse: half the protocol."""

    def fsdp_pre_all_gather(self, mesh):
        return (self._tensor,), None


def _wrap_weights(model: nn.Module, cls: type[_WrapperWeight]) -> nn.Module:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            weight = cls(module.weight.detach(), tag=name)
            module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    return model


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _mlp(dims: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for d_in, d_out in itertools.pairwise(dims):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _float8(model: nn.Module) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # emulate: CPU has no float8 matmul; the casts and the wire format are the real ones.
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    return convert_to_float8_training(model, config=config)


def _int8_mixed_precision(model: nn.Module) -> nn.Module:
    from torchao.prototype.quantized_training import int8_mixed_precision_training
    from torchao.quantization import quantize_

    # On torch 2.13 + torchao 0.18 the subclass's F.linear override does not fire (not
    # even without FSDP: _Int8MixedPrecisionTrainingLinearFunction is never called), so
    # the matmuls are plain bf16 ones; its fsdp_pre/post_all_gather (what this test is
    # about) still run.
    quantize_(model, int8_mixed_precision_training())
    return model


class _LoRALinear(nn.Module):
    """QLoRA-style: a frozen (NF4-quantized, or plain) base weight plus trainable
    rank-``rank`` adapters."""

    def __init__(self, features: int, rank: int, nf4: bool) -> None:
        super().__init__()
        self.nf4 = nf4
        weight = torch.randn(features, features) * features**-0.5
        if nf4:
            from torchao.quantization import to_nf4

            weight = to_nf4(weight)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lora_a = nn.Linear(features, rank, bias=False)
        self.lora_b = nn.Linear(rank, features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            base = linear_nf4(x, self.weight)
        else:
            base = nn.functional.linear(x, self.weight)
        return base + self.lora_b(self.lora_a(x))


def _lora_model(nf4: bool) -> nn.Module:
    return nn.Sequential(_LoRALinear(256, 8, nf4), nn.ReLU(), _LoRALinear(256, 8, nf4))


@dataclass(frozen=True)
class Scenario:
    """One model, how it is converted, and what ``fully_shard`` gets on each side."""

    build: Callable[[], nn.Module]  # the plain fp32 architecture
    convert: Callable[[nn.Module], nn.Module]
    in_features: int
    # (ours, torch's) fully_shard keyword arguments, built in the child.
    shard_kwargs: Callable[[], tuple[dict, dict]] = lambda: ({}, {})
    after_step: Callable[[nn.Module], None] | None = None
    # The unsharded type (name) of the first layer's weight inside forward.
    weight_type: str = ""
    smaller_than_fp32: bool = True  # whether the all-gather format is smaller than fp32
    needs_torchao: bool = True
    # The plain fp32 twin, if not ``build()`` itself.
    build_plain: Callable[[], nn.Module] | None = None


def _precompute(model: nn.Module) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _offload() -> tuple[dict, dict]:
    # pin_memory=False: pinning needs an accelerator (torch's raises without one).
    return (
        {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        {"offload_policy": TorchCPUOffloadPolicy(pin_memory=False)},
    )


def _bf16() -> tuple[dict, dict]:
    return (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        {"mp_policy": TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16)},
    )


def _mlp_64() -> nn.Sequential:
    return _mlp((64, 128, 64))  # float8 needs dims divisible by 16


SCENARIOS: dict[str, Scenario] = {
    "float8": Scenario(_mlp_64, _float8, 64, weight_type="Float8TrainingTensor"),
    "float8_precomputed_scale": Scenario(
        _mlp_64, _float8, 64, after_step=_precompute, weight_type="Float8TrainingTensor"
    ),
    "float8_cpu_offload": Scenario(
        _mlp_64, _float8, 64, shard_kwargs=_offload, weight_type="Float8TrainingTensor"
    ),
    "int8_mixed_precision": Scenario(
        _mlp_64,
        _int8_mixed_precision,
        64,
        shard_kwargs=_bf16,
        weight_type="Int8MixedPrecisionTrainingLinearWeight",
    ),
    # Built with NF4 base weights directly; the plain twin has fp32 ones.
    "nf4_lora": Scenario(
        lambda: _lora_model(nf4=True),
        lambda model: model,
        256,
        weight_type="NF4Tensor",
        build_plain=lambda: _lora_model(nf4=False),
    ),
    # 65 rows: rank 1's shard of the first weight (and its bias) is padded.
    "custom_uneven": Scenario(
        lambda: _mlp((16, 65, 16)),
        lambda model: _wrap_weights(model, _HiLoWeight),
        16,
        weight_type="Parameter",
        smaller_than_fp32=False,  # two bf16 tensors: as many bytes as fp32
        needs_torchao=False,
    ),
    "custom_one_arg": Scenario(
        lambda: _mlp((16, 32, 16)),
        lambda model: _wrap_weights(model, _AliasWeight),
        16,
        weight_type="_AliasWeight",
        smaller_than_fp32=False,  # fp32 unchanged
        needs_torchao=False,
    ),
}


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


def _build(scenario: Scenario, plain: bool) -> nn.Module:
    torch.manual_seed(0)
    if plain:
        return (scenario.build_plain or scenario.build)()
    return scenario.convert(scenario.build())


def _shard(model: nn.Module, mesh: DeviceMesh, shard: Callable, kwargs: dict) -> nn.Module:
    for module in model:
        if any(True for _ in module.parameters()):
            shard(module, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _unsharded_type(value: torch.Tensor) -> tuple[str, str | None, torch.dtype, tuple]:
    local = value.to_local() if isinstance(value, DTensor) else None
    return (
        type(value).__name__,
        None if local is None else type(local).__name__,
        value.dtype,
        tuple(value.shape),
    )


def _record_unsharded_types(model: nn.Module, seen: list) -> None:
    """After ``fully_shard``: every module with parameters of its own appends, at each
    forward, the type of each of them (as FSDP's pre-forward unshard left them)."""
    for name, module in model.named_modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue

        def hook(module: nn.Module, args: Any, name: str = name, names: list = names) -> None:
            seen.append((name, [(n, *_unsharded_type(getattr(module, n))) for n in names]))

        module.register_forward_pre_hook(hook)


def _batch(scenario: Scenario, rank: int) -> torch.Tensor:
    """This rank's batch, the same every step: the loss of ``model(x)**2`` goes down
    only on a repeated batch (that training happens at all)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(BATCH, scenario.in_features, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


@dataclass
class _Side:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    recorder: C10dRecorder = field(default_factory=C10dRecorder)
    unsharded_types: list = field(default_factory=list)


def _plain_all_gather_bytes(scenario: Scenario, mesh: DeviceMesh, rank: int) -> int:
    """All-gather bytes of one step of the plain fp32 architecture, under ours."""
    model = _shard(_build(scenario, plain=True), mesh, fully_shard, {})
    with C10dRecorder() as recorder:
        _loss(model, _batch(scenario, rank)).backward()
    return bytes_of(recorder.records, "all_gather")


def _collectives(records: list[tuple[str, int]]) -> dict[str, int]:
    return {
        "all_gather_bytes": bytes_of(records, "all_gather"),
        "all_gather_count": count_of(records, "all_gather"),
        # Gradient reduction: torch's reduce-scatter; ours is an all-to-all on gloo.
        "reduce_bytes": bytes_of(records, "reduce_scatter") + bytes_of(records, "all_to_all"),
        "all_reduce_bytes": bytes_of(records, "all_reduce"),
        "all_reduce_count": count_of(records, "all_reduce"),
        "other": [r for r in records if r[0] in ("broadcast", "other")],
    }


def _plain_parts(tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """A tensor subclass's plain inner tensors by ``name.attr`` (recursively, through
    ``__tensor_flatten__``), so that shards that do not implement ``torch.equal``
    (NF4) can be compared bitwise, and extra state (float8's precomputed scale) too."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return {name: tensor.detach().clone()}
    parts = {}
    for attr in tensor.__tensor_flatten__()[0]:
        parts.update(_plain_parts(getattr(tensor, attr), f"{name}.{attr}"))
    return parts


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per FQN (and inner tensor), this rank's local shard."""
    return {
        key: part
        for name, p in model.named_parameters()
        for key, part in _plain_parts(p.to_local(), name).items()
    }


def _train_side_by_side(rank: int, mesh: DeviceMesh, name: str) -> dict:
    scenario = SCENARIOS[name]
    ours_kwargs, their_kwargs = scenario.shard_kwargs()
    sides = []
    for shard, kwargs in ((fully_shard, ours_kwargs), (torch_fully_shard, their_kwargs)):
        model = _shard(_build(scenario, plain=False), mesh, shard, kwargs)
        trainable = [p for p in model.parameters() if p.requires_grad]
        side = _Side(model, torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1))
        _record_unsharded_types(model, side.unsharded_types)
        sides.append(side)
    ours, theirs = sides
    rec: dict[str, Any] = {
        "plain_all_gather_bytes": _plain_all_gather_bytes(scenario, mesh, rank),
        "sharded_types": [
            {n: type(p.to_local()).__name__ for n, p in s.model.named_parameters()} for s in sides
        ],
        "steps": [],
    }
    for step in range(STEPS):
        x = _batch(scenario, rank)
        srec: dict[str, Any] = {"loss": [], "post_all_gather_calls": []}
        for side in sides:
            side.recorder.records.clear()
            side.unsharded_types.clear()
            calls_before = len(POST_ALL_GATHER_CALLS)
            with side.recorder:
                loss = _loss(side.model, x)
                loss.backward()
            srec["loss"].append(loss.item())
            srec["post_all_gather_calls"].append(POST_ALL_GATHER_CALLS[calls_before:])
        srec["grads"] = local_trainable_grad_pairs(ours.model, theirs.model)
        for side in sides:
            with side.recorder:
                side.optimizer.step()
                side.optimizer.zero_grad()
                if scenario.after_step is not None:
                    scenario.after_step(side.model)
        srec["params"] = [_local_shards(s.model) for s in sides]
        srec["collectives"] = [_collectives(s.recorder.records) for s in sides]
        srec["unsharded_types"] = [list(s.unsharded_types) for s in sides]
        rec["steps"].append(srec)
    return rec


def _scenario_names() -> list[str]:
    return [n for n, s in SCENARIOS.items() if HAS_TORCHAO or not s.needs_torchao]


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            name: (lambda name=name: _train_side_by_side(rank, mesh, name))
            for name in _scenario_names()
        }
    )


# ---------------------------------------------------------------------------
# Parent side: training scenarios
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=240, pool=gloo_pool)


def _params(names: list[str]) -> list:
    return [
        pytest.param(n, marks=needs_torchao) if SCENARIOS[n].needs_torchao else n for n in names
    ]


@pytest.mark.parametrize("name", _params(list(SCENARIOS)))
def test_trains_bitwise_like_torch_fully_shard(run, name):
    for rank, rec in enumerate(scenario_records(run, name)):
        losses = []
        for step, srec in enumerate(rec["steps"]):
            where = f"rank {rank} step {step}"
            ours, theirs = srec["loss"]
            assert ours == theirs, f"{where} loss {ours!r} vs torch {theirs!r}"
            losses.append(ours)
            assert_pairs_equal(srec["grads"], f"{where} local grad vs torch")
            ours_shards, their_shards = srec["params"]
            assert list(ours_shards) == list(their_shards), f"{where}: the shards' inner tensors"
            shard_pairs = {k: (v, their_shards[k]) for k, v in ours_shards.items()}
            assert_pairs_equal(shard_pairs, f"{where} local shard vs torch")
        assert losses[-1] < losses[0], f"rank {rank}: did not train: {losses}"


@pytest.mark.parametrize("name", _params(list(SCENARIOS)))
def test_collectives_move_the_same_bytes_as_torch(run, name):
    scenario = SCENARIOS[name]
    for rank, rec in enumerate(scenario_records(run, name)):
        plain = rec["plain_all_gather_bytes"]
        for step, srec in enumerate(rec["steps"]):
            where = f"{name} rank {rank} step {step}"
            ours, theirs = srec["collectives"]
            assert ours == theirs, f"{where}: ours {ours} vs torch {theirs}"
            if scenario.smaller_than_fp32:
                assert ours["all_gather_bytes"] < plain, (
                    f"{where}: all-gathered {ours['all_gather_bytes']} bytes, no fewer than "
                    f"the plain fp32 model's {plain}: the extension's format was not used"
                )
            else:
                assert ours["all_gather_bytes"] == plain, where


@pytest.mark.parametrize("name", _params(list(SCENARIOS)))
def test_unsharded_params_in_forward_are_torchs_types(run, name):
    scenario = SCENARIOS[name]
    for rank, rec in enumerate(scenario_records(run, name)):
        for step, srec in enumerate(rec["steps"]):
            ours, theirs = srec["unsharded_types"]
            assert ours == theirs, f"rank {rank} step {step}:\nours  {ours}\ntorch {theirs}"
            # The first layer's weight, as its forward sees it.
            first = next(types for module, types in ours if module == "0")
            weight = {n: rest for n, *rest in first}["weight"]
            assert weight[0] == scenario.weight_type, f"rank {rank} step {step}: {first}"
        # And the sharded parameters' local tensors keep the subclass, as torch's.
        ours_sharded, their_sharded = rec["sharded_types"]
        assert ours_sharded == their_sharded, f"rank {rank}: sharded local types"


@needs_torchao
def test_precomputed_float8_scales_replace_the_per_weight_amax_all_reduces(run):
    """Without precomputed scales, each float8 weight's pre-all-gather all-reduces its
    amax at every unshard (2 weights x forward and backward); with them, the sharded
    local tensor carries the scale that ``precompute_float8_dynamic_scale_for_fsdp``
    set (one all-reduce after the optimizer step), so the pre-all-gather issues none."""
    for dynamic, precomputed in zip(
        scenario_records(run, "float8"),
        scenario_records(run, "float8_precomputed_scale"),
        strict=True,
    ):
        for step in range(1, STEPS):
            ours = precomputed["steps"][step]["collectives"][0]
            assert ours["all_reduce_count"] == 1, ours
            assert dynamic["steps"][step]["collectives"][0]["all_reduce_count"] == 4


@pytest.mark.parametrize("name", ["custom_uneven", "custom_one_arg"])
def test_post_all_gather_reuses_outputs_like_torch(run, name):
    for rank, rec in enumerate(scenario_records(run, name)):
        per_step = [srec["post_all_gather_calls"] for srec in rec["steps"]]
        for step, (ours, theirs) in enumerate(per_step):
            assert ours == theirs, f"rank {rank} step {step}:\nours  {ours}\ntorch {theirs}"
        # Step 0's forward builds each unsharded weight (out is None); every later
        # all-gather (step 0's backward, every later step) refreshes it with out=.
        first_calls = [call for call in per_step[0][0] if call[1]]
        assert sorted(tag for tag, _, _ in first_calls) == ["0", "2"], per_step[0][0]
        later = [call for calls in per_step[1:] for call in calls[0]]
        assert later and not any(is_first for _, is_first, _ in later), later
        inputs = 2 if name == "custom_uneven" else 1
        assert {n for _, _, n in later} == {inputs}


# ---------------------------------------------------------------------------
# Misuse, against torch's, in one process on the fake process group
# ---------------------------------------------------------------------------


def _raises(call: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
    """What ``call(*args, **kwargs)`` raises (it must raise)."""
    with pytest.raises(Exception) as info:
        call(*args, **kwargs)
    return info.value


def test_half_the_protocol_raises_assertion_error_at_fully_shard_like_torch():
    errors = []
    with fake_mesh(2) as mesh:
        for shard in (torch_fully_shard, fully_shard):
            model = _wrap_weights(_mlp((4, 6)), _PreOnlyWeight)
            errors.append(_raises(shard, model, mesh=mesh))
    theirs, ours = errors
    assert type(theirs) is type(ours) is AssertionError
    phrase = "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined"
    assert phrase in str(theirs) and phrase in str(ours)
    assert "'0.weight'" in str(ours), ours


@pytest.mark.parametrize("rank", [0, 1])
def test_unpadded_inputs_on_a_padded_rank_raise_like_torch(rank):
    """65 rows over 2 ranks: rank 1 holds 32 rows padded to 33, and only it can tell
    that the inputs lack the padding (rank 0 would wait in the all-gather)."""
    outcomes = []
    with fake_mesh(2, rank=rank) as mesh:
        for shard in (torch_fully_shard, fully_shard):
            torch.manual_seed(0)
            model = _wrap_weights(_mlp((4, 65)), _UnpaddedHiLoWeight)
            shard(model, mesh=mesh)
            outcomes.append(_raises(model, torch.randn(2, 4)))
    theirs, ours = outcomes
    if rank == 0:
        # Not padded: the inputs pass the check; the test's post_all_gather raises.
        assert "not reached" in str(theirs) and "not reached" in str(ours)
        return
    assert type(theirs) is type(ours) is AssertionError
    phrase = "fsdp_pre_all_gather must return all-gather inputs with the padded sharded size"
    assert phrase in str(theirs) and phrase in str(ours)
    assert "0.weight" in str(ours), ours


@pytest.mark.parametrize(
    "weight_cls,torch_error",
    [
        # One all-gather input: torch's forward passes, the backward's all-gather (from
        # the post-forward shard) raises NotImplementedError.
        (_AliasWeight, NotImplementedError),
        # Two inputs: torch's post-forward reshard trips an internal AssertionError
        # ("Expected 1 all_gather_output, got 2"); ours says NotImplementedError for
        # both, as for the one-input case.
        (_HiLoWeight, AssertionError),
    ],
)
def test_reshard_after_forward_int_raises_not_implemented_at_fully_shard(weight_cls, torch_error):
    """hpZ (reshard to a smaller mesh after forward) cannot keep an extension's
    outputs: torch fails in the first step, ours at fully_shard, before anything is
    sharded."""
    with fake_mesh(4) as mesh:
        torch.manual_seed(0)
        model = _wrap_weights(_mlp((4, 8, 4)), weight_cls)
        torch_fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
        torch_fully_shard(model, mesh=mesh)
        theirs = _raises(lambda: model(torch.randn(2, 4)).sum().backward())

        model = _wrap_weights(_mlp((4, 8, 4)), weight_cls)
        ours = _raises(fully_shard, model[0], mesh=mesh, reshard_after_forward=2)
    assert type(theirs) is torch_error, repr(theirs)
    assert type(ours) is NotImplementedError
    assert "reshard_after_forward=2" in str(ours) and "'weight'" in str(ours), ours


def test_inference_mode_forwards_work_where_torch_raises():
    """Two forwards under ``torch.inference_mode()`` from the start. Ours creates the
    extension's all-gather outputs at the first as inference tensors and, as torch's
    copy-out does, does not preserve version counters they do not have at the second.
    torch 2.13 does not get that far: its lazy init swaps the sharded local tensor
    under inference mode and raises (a README difference)."""
    outcomes = []
    with fake_mesh(2) as mesh:
        for shard in (torch_fully_shard, fully_shard):
            torch.manual_seed(0)
            model = _wrap_weights(_mlp((4, 8, 4)), _AliasWeight)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    shard(layer, mesh=mesh)
            shard(model, mesh=mesh)
            x = torch.randn(2, 4)
            try:
                with torch.inference_mode():
                    outcomes.append([model(x).shape, model(x).shape])
            except RuntimeError as error:
                outcomes.append(error)
    theirs, ours = outcomes
    assert isinstance(theirs, RuntimeError), theirs
    assert "inference tensor" in str(theirs)
    assert ours == [torch.Size((2, 4))] * 2
