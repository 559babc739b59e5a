"""Mixed precision, torch's ``test_fully_shard_mixed_precision.py`` family, on torch's
``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

Per training step both sides record the loss, the c10d collectives (their bytes carry
the all-gather and reduce dtypes), every local grad and every local shard after an
Adam step, and where a case is about casts, the dtypes each module saw; compared
bitwise wherever the reduction runs in fp32 (both sides sum the same low-precision
grads in fp32 and halve them). A bf16 reduction is not the same arithmetic (torch asks
gloo for an AVG reduce-scatter, ours sums the two shards locally after an all-to-all),
so ``bf16_model_to_fp32`` compares its grads to one bf16 rounding (see the test).

- ``compute``: bf16 and fp16 compute with an fp32 reduction, per
  ``reshard_after_forward`` True, False and 1, sharded on dim 0 or on each parameter's
  largest dim (torch's ``test_compute_dtype``, ``test_reduce_dtype``);
- ``accumulation``: bf16 compute, fp32 reduction, four micro-batches without sync and
  ``set_reshard_after_backward`` off until the last (torch's
  ``test_grad_acc_with_reduce_dtype``);
- ``bf16_model_to_fp32``: a model built in bf16 and cast to fp32 after ``fully_shard``
  with a bf16 reduce dtype (torch's ``test_clamp_reduce_dtype``);
- ``recompute_casts``: activation checkpointing re-running a module whose inputs (or
  outputs) the policy casts (torch's ``test_checkpoint_recompute_casts_*``);
- ``one_submodule``: fp16 on one child only, the cast done by FSDP, by the user, or by
  the previous child's ``output_dtype`` (torch's ``test_float16_on_one_submodule``);
- ``external_inputs``: a child given a tensor that did not come from its parent's
  inputs, with and without its own cast (torch's ``test_submodules_with_external_inputs``);
- ``norms``: LayerNorm, BatchNorm1d, BatchNorm2d (fp32 buffers, buffers cast, or the
  norm in its own group with only ``output_dtype``) under bf16 (torch's
  ``test_norm_modules_bf16``);
- ``list_group_cast``: a list group whose second module gets an fp32 tensor from the
  first (torch's ``test_grouped_module_cast_forward_inputs``);
- ``jvp``: forward-mode AD (``torch.func.jvp``) through a module built on meta, sharded
  with ``reshard_after_forward=False`` and bf16 casts, never run before (torch's
  ``test_no_warmup_jvp_reshard_after_forward_false``).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from tests.runtime.scenarios._side_by_side import (
    Side,
    assert_pairs_same,
    assert_same,
    cases_fixture,
    checked,
    rank_input,
    side_records,
    train,
)

DIM, ROWS, STEPS = 8, 4, 3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).relu())


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


def _blocks(side: Side, mesh: DeviceMesh, policy: Any, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(42)
    model = nn.Sequential(*(Block() for _ in range(3)))
    for block in model:
        side.fully_shard(block, mesh=mesh, mp_policy=policy, **kwargs)
    side.fully_shard(model, mesh=mesh, mp_policy=policy, **kwargs)
    return model


def _compute(
    side: Side, mesh: DeviceMesh, dtype: torch.dtype, raf: bool | int, largest: bool
) -> list[dict]:
    policy = side.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=FP32)
    placement = _largest_dim if largest else None
    model = _blocks(side, mesh, policy, reshard_after_forward=raf, shard_placement_fn=placement)
    return train(
        model, STEPS, lambda step: model(rank_input(step, ROWS, DIM, dtype=dtype)).float().sum()
    )


def _accumulation(side: Side, mesh: DeviceMesh, raf: bool) -> list[dict]:
    policy = side.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model = _blocks(side, mesh, policy, reshard_after_forward=raf)
    micro_batches = 4

    def loss(step: int) -> torch.Tensor:
        # All but the last micro-batch accumulate unreduced (in fp32) and, with
        # reshard_after_forward=False, keep their params; the last reduces.
        for micro in range(micro_batches - 1):
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(raf)
            model(rank_input(10 * step + micro, ROWS, DIM, dtype=BF16)).float().sum().backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        return model(rank_input(10 * step + micro_batches, ROWS, DIM, dtype=BF16)).float().sum()

    return train(model, STEPS, loss)


def _bf16_model_to_fp32(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM, dtype=BF16), nn.Linear(DIM, DIM, dtype=BF16))
    policy = side.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    for module in model:
        side.fully_shard(module, mesh=mesh, mp_policy=policy)
    side.fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to(FP32)  # the reduction stays in bf16: the policy says so
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).float().sum())


# ---------------------------------------------------------------------------
# What dtypes modules see
# ---------------------------------------------------------------------------


class Recording(nn.Linear):
    """A Linear that records the dtype of every input it sees (recomputation too)."""

    def __init__(self, seen: list, d_in: int = DIM, d_out: int = DIM) -> None:
        super().__init__(d_in, d_out)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(str(x.dtype))
        return super().forward(x)


def _dtype_steps(model: nn.Module, seen: list, x_dtype: torch.dtype = FP32) -> dict:
    steps = train(
        model, 2, lambda step: model(rank_input(step, ROWS, DIM, dtype=x_dtype)).float().sum()
    )
    return {"steps": steps, "seen": list(seen)}


class RecomputeModel(nn.Module):
    def __init__(self, seen: list, checkpoint_dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = Recording(seen)
        self.checkpoint_dtype = checkpoint_dtype
        self.outputs: list = seen

    def _checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.outputs.append(f"out {out.dtype}")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # early_stop=False: the recomputation runs the whole region, outputs included.
        x = checkpoint(
            self._checkpointed, x.to(self.checkpoint_dtype), use_reentrant=False, early_stop=False
        )
        return x.float()


def _recompute_casts(side: Side, mesh: DeviceMesh, what: str) -> dict:
    torch.manual_seed(42)
    seen: list = []
    if what == "input":  # fp32 into the checkpoint: the policy casts it, also on recompute
        model = RecomputeModel(seen, FP32)
        policy = side.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    else:  # the policy casts the output back to fp32, also on recompute
        model = RecomputeModel(seen, BF16)
        policy = side.MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32, cast_forward_inputs=False
        )
    side.fully_shard(model.linear, mesh=mesh, mp_policy=policy)
    side.fully_shard(model, mesh=mesh, mp_policy=policy)
    return _dtype_steps(model, seen)


class TwoChildren(nn.Module):
    def __init__(self, seen: list, user_cast: bool) -> None:
        super().__init__()
        self.c1 = Recording(seen)
        self.c2 = Recording(seen)
        self.user_cast = user_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c1(x)
        if self.user_cast:  # the user casts for c2's fp16 params
            x = x.to(FP16)
        return self.c2(x)


def _one_submodule(side: Side, mesh: DeviceMesh, how: str) -> dict:
    torch.manual_seed(42)
    seen: list = []
    policy = side.MixedPrecisionPolicy
    model = TwoChildren(seen, user_cast=how == "user_cast")
    if how == "fsdp_cast":
        side.fully_shard(model.c2, mesh=mesh, mp_policy=policy(param_dtype=FP16, reduce_dtype=FP32))
    elif how == "user_cast":
        side.fully_shard(
            model.c2,
            mesh=mesh,
            mp_policy=policy(param_dtype=FP16, reduce_dtype=FP32, cast_forward_inputs=False),
        )
    else:  # c1 computes in fp16 and hands c2 fp32
        side.fully_shard(
            model.c1,
            mesh=mesh,
            mp_policy=policy(param_dtype=FP16, reduce_dtype=FP32, output_dtype=FP32),
        )
    side.fully_shard(model, mesh=mesh)
    return _dtype_steps(model, seen)


class TakesExternal(nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.seen = seen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(f"x {x.dtype} y {y.dtype}")
        return self.lin(x) + y


class ExternalModel(nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, DIM)
        self.l2 = TakesExternal(seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(ROWS, DIM)  # made here, fp32: not one of the root's inputs
        return self.l2(self.l1(x), y)


def _external_inputs(side: Side, mesh: DeviceMesh, child_cast: bool) -> dict:
    torch.manual_seed(42)
    seen: list = []
    model = ExternalModel(seen)
    policy = side.MixedPrecisionPolicy
    side.fully_shard(
        model.l2,
        mesh=mesh,
        mp_policy=policy(param_dtype=FP16, reduce_dtype=FP32, cast_forward_inputs=child_cast),
    )
    side.fully_shard(model, mesh=mesh, mp_policy=policy(param_dtype=FP16, reduce_dtype=FP32))
    return _dtype_steps(model, seen)


def _norm_model(kind: str) -> tuple[nn.Sequential, tuple[int, ...]]:
    if kind == "layernorm":
        return nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM)), (
            ROWS,
            DIM,
        )
    if kind == "batchnorm1d":
        return nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Linear(DIM, DIM)), (
            ROWS,
            DIM,
        )
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 3))
    return model, (3, 1, 7, 7)


def _norms(side: Side, mesh: DeviceMesh, kind: str) -> dict:
    torch.manual_seed(42)
    model, shape = _norm_model(kind)
    policy = side.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    if kind == "batchnorm2d_own_policy":  # the norm computes in fp32, hands on bf16
        side.fully_shard(
            model[1], mesh=mesh, mp_policy=side.MixedPrecisionPolicy(output_dtype=BF16)
        )
        children = (model[0], model[2])
    else:
        children = tuple(model)
    for module in (*children, model):
        side.fully_shard(module, mesh=mesh, mp_policy=policy)
    if kind == "batchnorm2d_cast_buffers":
        model[1].running_mean = model[1].running_mean.to(BF16)
        model[1].running_var = model[1].running_var.to(BF16)
    outputs: list = []

    def loss(step: int) -> torch.Tensor:
        out = model(rank_input(step, *shape))
        outputs.append(str(out.dtype))
        return out.float().sum()

    try:
        steps = train(model, STEPS, loss)
    except RuntimeError as exc:  # bf16 activations with fp32 batch-norm stats, on CPU
        return {"error": str(exc).splitlines()[0]}
    return {"steps": steps, "out_dtypes": outputs, "buffers": [b.clone() for b in model.buffers()]}


class ListGroupModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM, bias=False)
        self.b = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())  # fp32 into b: only b's own cast makes it bf16


def _list_group_cast(side: Side, mesh: DeviceMesh) -> dict:
    torch.manual_seed(42)
    model = ListGroupModel()
    policy = side.MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True
    )
    side.fully_shard([model.a, model.b], mesh=mesh, mp_policy=policy)
    side.fully_shard(model, mesh=mesh, mp_policy=policy)
    dtypes: list = []

    def loss(step: int) -> torch.Tensor:
        out = model(rank_input(step, ROWS, DIM))
        dtypes.append(str(out.dtype))
        return out.float().sum()

    return {"steps": train(model, STEPS, loss), "out_dtypes": dtypes}


def _jvp(side: Side, mesh: DeviceMesh) -> dict:
    policy = side.MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True
    )
    with torch.device("meta"):
        enc, dec = nn.Linear(16, 32, bias=False), nn.Linear(32, 24, bias=False)
    for index, module in enumerate((enc, dec)):  # two roots
        side.fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        module.to_empty(device="cpu")
        torch.manual_seed(42 + index)
        with torch.no_grad():
            module.weight.normal_(std=module.in_features**-0.5)
    encoded = enc(rank_input(0, 16, dtype=BF16))
    primal = rank_input(1, 24, dtype=BF16).requires_grad_(True)
    tangent = rank_input(2, 24, dtype=BF16)
    # dec's output does not depend on the primal: its tangent is zero.
    output, tangent_out = torch.func.jvp(lambda unused: dec(encoded), (primal,), (tangent,))
    return {"output": output.detach(), "tangent": tangent_out.detach()}


# ---------------------------------------------------------------------------
# The spawn
# ---------------------------------------------------------------------------


def _raf_id(raf: bool | int) -> str:
    return f"raf={raf}"


COMPUTE = [
    (d, raf, largest) for d in (BF16, FP16) for raf in (True, False, 1) for largest in (False, True)
]
NORMS = (
    "layernorm",
    "batchnorm1d",
    "batchnorm2d",
    "batchnorm2d_cast_buffers",
    "batchnorm2d_own_policy",
)
ONE_SUBMODULE = ("fsdp_cast", "user_cast", "output_dtype")


def _compute_id(dtype: torch.dtype, raf: bool | int, largest: bool) -> str:
    return f"compute-{str(dtype).removeprefix('torch.')}-{_raf_id(raf)}-largest_dim={largest}"


CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {
    "bf16_model_to_fp32": _bf16_model_to_fp32,
    "list_group_cast": _list_group_cast,
    "jvp": _jvp,
}
for _case in COMPUTE:
    CASES[_compute_id(*_case)] = lambda s, m, c=_case: _compute(s, m, *c)
for _raf in (True, False):
    CASES[f"accumulation-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _accumulation(s, m, r)
for _what in ("input", "output"):
    CASES[f"recompute_casts-{_what}"] = lambda s, m, w=_what: _recompute_casts(s, m, w)
for _how in ONE_SUBMODULE:
    CASES[f"one_submodule-{_how}"] = lambda s, m, h=_how: _one_submodule(s, m, h)
for _cast in (False, True):
    CASES[f"external_inputs-child_cast={_cast}"] = lambda s, m, c=_cast: _external_inputs(s, m, c)
for _kind in NORMS:
    CASES[f"norms-{_kind}"] = lambda s, m, k=_kind: _norms(s, m, k)


run = cases_fixture(__name__)


def _reduce_bytes(steps: list[dict]) -> set[int]:
    return {
        nbytes for step in steps for kind, nbytes in step["collectives"] if kind == "reduce_scatter"
    }


@pytest.mark.parametrize(
    "dtype,raf,largest", COMPUTE, ids=[_compute_id(*c).removeprefix("compute-") for c in COMPUTE]
)
def test_low_precision_compute_with_fp32_reduction_matches_torch(run, dtype, raf, largest) -> None:
    for ours, _ in checked(run, _compute_id(dtype, raf, largest)):
        # A block's fp32 reduce-scatter input: (4*D*D + 4*D) + (4*D*D + D) elements.
        assert _reduce_bytes(ours) == {(8 * DIM * DIM + 5 * DIM) * 4}
        assert all(g.dtype == FP32 for step in ours for g in step["grads"].values())


@pytest.mark.parametrize("raf", [True, False], ids=_raf_id)
def test_accumulation_with_fp32_reduction_matches_torch(run, raf) -> None:
    checked(run, f"accumulation-{_raf_id(raf)}")


def test_bf16_model_cast_to_fp32_keeps_a_bf16_reduction_like_torch(run) -> None:
    for rank, (ours, theirs) in enumerate(side_records(run, "bf16_model_to_fp32")):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            where = f"rank {rank} step {step}"
            assert mine["collectives"] == torchs["collectives"], where
            # Reduced in bf16: each Linear's reduce-scatter input is bf16 (2 bytes).
            assert _reduce_bytes([mine]) == {(DIM * DIM + DIM) * 2}, where
            # torch: gloo's AVG of the two bf16 grads; ours: their sum, then halved.
            # Each is one bf16 rounding of the exact mean, so they differ by at most
            # one bf16 ulp (2**-8 relative) wherever they differ.
            for name, grad in mine["grads"].items():
                torch.testing.assert_close(
                    grad, torchs["grads"][name], rtol=2**-8, atol=0, msg=where
                )
            if step == 0:  # the same params: the same forward
                assert_same(mine["loss"], torchs["loss"], where)


@pytest.mark.parametrize("what", ["input", "output"])
def test_recomputation_casts_like_the_first_forward_like_torch(run, what) -> None:
    for ours, _ in checked(run, f"recompute_casts-{what}"):
        # Per step: the input dtype, the output dtype, then the same in recomputation.
        assert ours["seen"] == ours["seen"][:2] * 4, ours["seen"]


@pytest.mark.parametrize("how", ONE_SUBMODULE)
def test_fp16_on_one_submodule_matches_torch(run, how) -> None:
    checked(run, f"one_submodule-{how}")


@pytest.mark.parametrize("child_cast", [False, True], ids=lambda c: f"child_cast={c}")
def test_submodule_with_an_external_input_matches_torch(run, child_cast) -> None:
    checked(run, f"external_inputs-child_cast={child_cast}")


@pytest.mark.parametrize("kind", NORMS)
def test_norm_modules_under_bf16_match_torch(run, kind) -> None:
    # On CPU, batch norm's kernels refuse bf16 inputs with fp32 running stats: both raise
    # the same error there (torch's test expects that on CUDA only); the rest train.
    pairs = side_records(run, f"norms-{kind}")
    assert_pairs_same(pairs)
    for ours, _ in pairs:
        assert ("error" in ours) == (kind in ("batchnorm1d", "batchnorm2d")), ours.get("error")


def test_list_group_casts_each_modules_inputs_like_torch(run) -> None:
    for ours, _ in checked(run, "list_group_cast"):
        assert set(ours["out_dtypes"]) == {"torch.bfloat16"}


def test_jvp_through_a_module_never_run_before_matches_torch(run) -> None:
    pairs = side_records(run, "jvp")
    assert_pairs_same(pairs)
    for ours, _ in pairs:
        assert ours["output"].dtype == BF16 and not ours["tangent"].any()
