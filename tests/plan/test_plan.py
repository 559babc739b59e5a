"""plan() on the fake process group: its totals add up, composing a long stack from
short ones equals simulating it whole, bad input fails early and clearly, the fake
group never outlives the call, and the CLI runs."""

import dataclasses
import functools
import inspect
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention import SDPBackend
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtensor_fsdp import Plan, auto_shard, plan
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from dtensor_fsdp.plan import replan
from dtensor_fsdp.plan.compose import compose
from dtensor_fsdp.plan.recorders import FrozenSafeMemTracker
from dtensor_fsdp.plan.settings import PlanSettings
from tests._tiny_llama import frozen_tiny_llama

CONFIG = LlamaConfig.tiny()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _plan(world_size: int = 4, n_layers: int = 2, **settings) -> Plan:
    config = dataclasses.replace(CONFIG, n_layers=n_layers)
    return plan(
        lambda: Llama(config),
        world_size=world_size,
        batch=lambda: torch.randint(0, config.vocab_size, (2, 33)),
        **{"loss_fn": _loss, **settings},
    )


@functools.cache
def _plan_once(world_size: int = 4, n_layers: int = 2) -> Plan:
    """``_plan`` with the default settings, simulated once per shape for the tests that
    only read it (a plan is deterministic); not for a test that expects an error."""
    return _plan(world_size=world_size, n_layers=n_layers)


@pytest.fixture(scope="module", params=[4, 3], ids=["W4", "W3_padded"])
def adamw_plan(request: pytest.FixtureRequest) -> Plan:
    """W=4 divides every dim 0 of the tiny Llama; W=3 pads every shard."""
    return _plan_once(world_size=request.param)


def test_breakdown_adds_up_to_peak(adamw_plan: Plan) -> None:
    assert sum(adamw_plan.peak_breakdown.values()) == adamw_plan.peak_bytes > 0
    assert adamw_plan.peak_phase in ("forward", "backward", "optimizer step")


def test_sharded_bytes_cover_the_model(adamw_plan: Plan) -> None:
    p = adamw_plan
    # Shards are padded to ceil(dim0 / W) rows: W of them cover the model, with at
    # most W - 1 padding rows per parameter on top.
    assert p.model_bytes <= p.sharded_param_bytes * p.world_size < 1.1 * p.model_bytes
    assert p.sharded_grad_bytes == p.sharded_param_bytes
    # AdamW: exp_avg and exp_avg_sq per element, and a 4-byte step per parameter.
    n_params = len(list(Llama(CONFIG).parameters()))
    assert p.optimizer_state_bytes == 2 * p.sharded_param_bytes + 4 * n_params
    assert sum(g.params for g in p.groups) == p.model_params
    assert sum(g.unsharded_bytes for g in p.groups) == p.sharded_param_bytes * p.world_size


def test_collectives_per_group(adamw_plan: Plan) -> None:
    """Blocks resharded after forward all-gather twice, the root (kept) once; every
    group reduce-scatters once; the c10d count equals the groups' sum."""
    by_fqn = {g.fqn: g for g in adamw_plan.groups}
    assert {fqn: g.collectives["all_gather"]["count"] for fqn, g in by_fqn.items()} == {
        "": 1,
        "layers.0": 2,
        "layers.1": 2,
    }
    for g in adamw_plan.groups:
        assert g.collectives["reduce_scatter"] == {"count": 1, "bytes": g.unsharded_bytes}
    assert adamw_plan.collectives["all_gather"]["count"] == 5
    assert adamw_plan.collectives["reduce_scatter"]["bytes"] == sum(
        g.unsharded_bytes for g in adamw_plan.groups
    )
    assert (
        adamw_plan.forward_flops > 0 and adamw_plan.backward_flops == 2 * adamw_plan.forward_flops
    )


@pytest.mark.parametrize(
    "frozen",
    [("layers.0",), ("tok_embeddings",), ("tok_embeddings", "layers.0")],
    ids=["block", "embedding", "prefix"],
)
def test_frozen_params_are_gathered_not_reduced(frozen: tuple[str, ...]) -> None:
    """Fine-tuning: each group all-gathers all its params as before (a frozen block
    not reached by the backward, the prefix's layers.0, is gathered again as the
    prefetch of layers.1's backward), reduce-scatters only those with a gradient, and
    not at all when it has none; no gradient or optimizer state for frozen params."""
    full, tuned = (
        _plan_once(),
        plan(
            frozen_tiny_llama(*frozen),
            world_size=4,
            batch=lambda: torch.randint(0, CONFIG.vocab_size, (2, 33)),
            loss_fn=_loss,
        ),
    )
    # W=4 divides every dim 0 of the tiny Llama: no padding, shards are a quarter.
    frozen_bytes = {
        fqn: sum(p.numel() * 4 for p in frozen_tiny_llama()().get_submodule(fqn).parameters())
        for fqn in frozen
    }
    group_of = {"layers.0": "layers.0", "tok_embeddings": ""}
    for before, after in zip(full.groups, tuned.groups, strict=True):
        assert after.collectives["all_gather"] == before.collectives["all_gather"]
        rs_bytes = before.collectives["reduce_scatter"]["bytes"] - sum(
            nbytes for fqn, nbytes in frozen_bytes.items() if group_of[fqn] == after.fqn
        )
        expected = {"count": 1, "bytes": rs_bytes} if rs_bytes else None
        assert after.collectives.get("reduce_scatter") == expected, after.fqn
    assert full.sharded_grad_bytes - tuned.sharded_grad_bytes == sum(frozen_bytes.values()) // 4
    assert tuned.optimizer_state_bytes < full.optimizer_state_bytes
    assert tuned.peak_bytes < full.peak_bytes


def test_frozen_safe_tracker_fails_loudly_if_memtracker_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The method it overrides is private to torch: if a release renames it, the
    tracker refuses to start rather than be silently bypassed."""
    monkeypatch.delattr(MemTracker, "_track_module_params_and_buffers")
    with pytest.raises(RuntimeError, match="update FrozenSafeMemTracker"):
        FrozenSafeMemTracker()


def test_to_json_and_table(adamw_plan: Plan) -> None:
    figures = json.loads(adamw_plan.to_json())
    assert figures["peak_bytes"] == adamw_plan.peak_bytes
    assert [g["fqn"] for g in figures["groups"]] == ["", "layers.0", "layers.1"]
    text = str(adamw_plan)
    assert "predicted peak" in text and "layers.1" in text


def test_replan_sgd_has_no_optimizer_state(adamw_plan: Plan) -> None:
    sgd = replan(adamw_plan, optimizer="sgd")
    assert sgd.optimizer_state_bytes == 0
    assert sgd.peak_bytes < adamw_plan.peak_bytes
    assert sgd.collectives == adamw_plan.collectives


def test_gloo_backend_plans_ours_all_to_all_reduce_scatter(adamw_plan: Plan) -> None:
    # On gloo ours reduce-scatters by an all-to-all (same bytes) whose receive buffer,
    # as large as the input, is alive with it: the peak can only grow.
    on_gloo = replan(adamw_plan, backend="gloo")
    assert on_gloo.backend == "gloo" and adamw_plan.backend == "nccl"
    assert on_gloo.collectives["all_to_all"] == adamw_plan.collectives["reduce_scatter"]
    assert "reduce_scatter" not in on_gloo.collectives
    assert on_gloo.collectives["all_gather"] == adamw_plan.collectives["all_gather"]
    assert on_gloo.peak_bytes > adamw_plan.peak_bytes
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        replan(adamw_plan, backend="mpi")


def test_math_attention_kernel_adds_the_attention_weights(adamw_plan: Plan) -> None:
    # CUDA runs the math kernel for fp32 grouped-query attention; it saves each block's
    # softmax weights (batch x heads x seq x seq) that the CPU's flash kernel does not,
    # all alive at the backward's start (the peak). Collectives do not change.
    math = replan(adamw_plan, sdpa_backends=(SDPBackend.MATH,))
    batch, seq = 2, 32
    weights = CONFIG.n_heads * batch * seq * seq * 4  # fp32 bytes per block
    assert math.peak_bytes - adamw_plan.peak_bytes >= CONFIG.n_layers * weights
    assert math.collectives == adamw_plan.collectives
    assert math.peak_phase == "backward"
    with pytest.raises(ValueError, match="sdpa_backends must be a non-empty tuple"):
        replan(adamw_plan, sdpa_backends=("math",))


def test_compose_equals_whole_simulation() -> None:
    whole = _plan(n_layers=6)
    composed = compose(_plan_once(n_layers=3), _plan_once(n_layers=4), 6)
    for field in (
        "peak_bytes",
        "peak_breakdown",
        "peak_module",
        "peak_phase",
        "collectives",
        "sharded_param_bytes",
        "optimizer_state_bytes",
        "forward_flops",
    ):
        assert getattr(composed, field) == getattr(whole, field), field
    assert [dataclasses.replace(g, comm_s={}) for g in composed.groups] == [
        dataclasses.replace(g, comm_s={}) for g in whole.groups
    ]


def test_a_model_instance_is_planned_on_a_copy() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = [p.clone() for p in model.parameters()]
    p = plan(model, world_size=2, batch=torch.randn(8, 16))
    assert [g.fqn for g in p.groups] == [""]  # no ModuleList: one group
    assert p.model_params == sum(x.numel() for x in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_no_batch_raises() -> None:
    with pytest.raises(ValueError, match="needs one example batch"):
        plan(lambda: Llama(CONFIG), world_size=2, batch=None)


def test_replicate_must_divide_world_size() -> None:
    with pytest.raises(ValueError, match=r"world_size \(6\) is not divisible by replicate \(4\)"):
        plan(lambda: Llama(CONFIG), world_size=6, batch=torch.zeros(1, 8), replicate=4)


def test_initialized_default_group_is_refused_and_kept() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="before init_process_group"):
            _plan()
        assert dist.is_initialized() and dist.get_world_size() == 2
    finally:
        dist.destroy_process_group()


def test_fake_group_destroyed_on_error() -> None:
    def failing_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        _plan(loss_fn=failing_loss)
    assert not dist.is_initialized()


def test_unsharded_root_is_refused() -> None:
    with pytest.raises(TypeError, match="without fully_shard"):
        _plan(shard_fn=lambda model, **kwargs: None)


def test_cli_tiny_json(tmp_path) -> None:
    path = tmp_path / "plan.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtensor_fsdp.plan",
            "--model",
            "tiny",
            "--world-size",
            "4",
            "--seq",
            "32",
            "--budget-gib",
            "1",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "predicted peak" in result.stdout and "fits" in result.stdout
    figures = json.loads(path.read_text())
    assert figures["world_size"] == 4 and figures["peak_bytes"] > 0


def _settings_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(PlanSettings)}


def _default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default


@pytest.mark.parametrize("entry", [plan, auto_shard], ids=["plan", "auto_shard"])
def test_settings_are_typed_keyword_arguments(entry) -> None:
    # Every PlanSettings field (but auto_shard's choice, shard_fn) is a keyword-only
    # argument with the field's type and default, so that an IDE and a type checker
    # see them; the model alone is positional.
    params = inspect.signature(entry).parameters
    fields = _settings_fields()
    if entry is auto_shard:
        del fields["shard_fn"]
    for name, field in fields.items():
        param = params[name]
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if name == "model" else param.KEYWORD_ONLY
        assert param.kind == kind, name
        assert param.annotation == field.type, name
        assert param.default == _default(field), name
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_replan_takes_each_setting_by_name() -> None:
    params = inspect.signature(replan).parameters
    assert set(params) - {"previous"} == set(_settings_fields())
    assert all(p.kind == p.KEYWORD_ONLY for name, p in params.items() if name != "previous")


@pytest.mark.parametrize("entry", ["plan", "replan", "auto_shard"])
def test_unknown_setting_is_a_type_error_naming_it(adamw_plan: Plan, entry: str) -> None:
    calls = {
        "plan": lambda: _plan(link_gpbs=100.0),
        "replan": lambda: replan(adamw_plan, link_gpbs=100.0),
        "auto_shard": lambda: auto_shard(
            lambda: nn.Linear(4, 4),
            budget_bytes=2**30,
            world_size=2,
            batch=torch.randn(2, 4),
            link_gpbs=100.0,
        ),
    }
    with pytest.raises(
        TypeError, match=f"{entry}\\(\\) got an unexpected keyword argument 'link_gpbs'"
    ):
        calls[entry]()
    assert not dist.is_initialized()


def test_replan_of_a_composed_plan_is_refused() -> None:
    composed = compose(_plan_once(n_layers=3), _plan_once(n_layers=4), 6)
    with pytest.raises(ValueError, match="a composed plan has none"):
        replan(composed, optimizer="sgd")
