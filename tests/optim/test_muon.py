"""``dtensor_fsdp.optim.Muon`` in one process: torch.optim.Muon's math, defaults and
errors; owner assignment and the all-to-all plan; ``split_muon_params``.

Multi-rank behaviour (the owner exchange, checkpoints, torch's ``fully_shard``) is in
tests/optim/test_muon_gloo.py.
"""

import dataclasses
import inspect

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

from dtensor_fsdp.models.llama import Llama, LlamaConfig
from dtensor_fsdp.optim import Muon, split_muon_params
from dtensor_fsdp.optim.muon import zeropower_via_newtonschulz
from dtensor_fsdp.optim.owner import OwnerPlan, ShardedMatrix, assign_owners, plan_owners
from tests._harness import fake_mesh

SHAPES = [(64, 32), (32, 64), (48, 48), (65, 24), (3, 40)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


# ---------------------------------------------------------------------------
# The math: bitwise torch.optim.Muon's
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_is_torchs(shape: tuple[int, int]) -> None:
    update = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(
        zeropower_via_newtonschulz(update, *args), torch_newton_schulz(update, *args)
    )


SETTINGS = {
    "defaults": {},
    "no_nesterov": {"nesterov": False, "momentum": 0.9},
    "original": {"adjust_lr_fn": "original", "lr": 0.02, "weight_decay": 0.0},
    "match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.01},
    "ns": {"ns_steps": 3, "ns_coefficients": (3.0, -3.2, 1.2), "eps": 1e-5},
    "tensor_lr": {"lr": torch.tensor(0.01)},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_step_is_bitwise_torchs_on_plain_tensors(setting: str) -> None:
    ours, theirs = _params(), _params()
    opts = Muon(ours, **SETTINGS[setting]), torch.optim.Muon(theirs, **SETTINGS[setting])
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        for opt in opts:
            opt.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opts[0].state[a]["momentum_buffer"], opts[1].state[b]["momentum_buffer"])
    assert not torch.equal(ours[0], _params()[0])


def test_defaults_and_state_dict_layout_are_torchs() -> None:
    ours, theirs = inspect.signature(Muon), inspect.signature(torch.optim.Muon)
    assert {n: p.default for n, p in ours.parameters.items()} == {
        n: p.default for n, p in theirs.parameters.items()
    }
    opts = Muon(_params()), torch.optim.Muon(_params())
    for opt in opts:
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
    sds = [opt.state_dict() for opt in opts]
    assert sds[0]["param_groups"] == sds[1]["param_groups"]
    assert {k: sorted(v) for k, v in sds[0]["state"].items()} == {
        k: sorted(v) for k, v in sds[1]["state"].items()
    }
    # A state dict of one loads into the other: users can switch.
    switched = Muon(_params())
    switched.load_state_dict(sds[1])
    assert torch.equal(
        switched.state_dict()["state"][0]["momentum_buffer"], sds[1]["state"][0]["momentum_buffer"]
    )


# ---------------------------------------------------------------------------
# Errors: torch's type and phrase
# ---------------------------------------------------------------------------

BAD_ARGS = {
    "1d_param": ([nn.Parameter(torch.ones(3))], {}, "Muon only supports 2D parameters"),
    "3d_param": ([nn.Parameter(torch.ones(2, 3, 4))], {}, "Muon only supports 2D parameters"),
    "negative_lr": (None, {"lr": -1.0}, "Learning rate should be >= 0"),
    "negative_momentum": (None, {"momentum": -0.1}, "momentum should be >= 0"),
    "negative_weight_decay": (None, {"weight_decay": -0.1}, "weight decay should be >= 0"),
    "adjust_lr_fn": (None, {"adjust_lr_fn": "adam"}, "Adjust learning rate function adam"),
    "tensor_lr": (None, {"lr": torch.ones(2)}, "Tensor lr must be 1-element"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_construction_errors_match_torch(case: str) -> None:
    params, kwargs, phrase = BAD_ARGS[case]
    errors = []
    for cls in (torch.optim.Muon, Muon):
        with pytest.raises(Exception) as info:
            cls(params if params is not None else _params(), **kwargs)
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0]) is ValueError
    assert phrase in str(errors[0]) and phrase in str(errors[1])


def test_non_2d_error_names_the_parameter_and_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'0\.bias'.*split_muon_params"):
        Muon(model.named_parameters())
    with pytest.raises(ValueError, match=r"#1 of its param group"):
        Muon(model.parameters())


STEP_ERRORS = {
    "complex": (lambda p: (torch.complex(p, p), None), "Muon does not support complex parameters"),
    "sparse_grad": (
        lambda p: (p, p.detach().to_sparse()),
        "Muon does not support sparse gradients",
    ),
}


@pytest.mark.parametrize("case", STEP_ERRORS)
def test_step_errors_match_torch(case: str) -> None:
    make, phrase = STEP_ERRORS[case]
    errors = []
    for cls in (torch.optim.Muon, Muon):
        value, grad = make(torch.ones(3, 3))
        param = nn.Parameter(value)
        param.grad = grad if grad is not None else torch.ones_like(param)
        optimizer = cls([param])
        with pytest.raises(Exception) as info:
            optimizer.step()
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0]) is RuntimeError
    assert phrase in str(errors[0]) and phrase in str(errors[1])


def test_ns_steps_error_matches_torch() -> None:
    errors = []
    for cls in (torch.optim.Muon, Muon):
        param = nn.Parameter(torch.ones(3, 3))
        param.grad = torch.ones_like(param)
        with pytest.raises(Exception) as info:
            cls([param], ns_steps=100).step()
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0]) is ValueError
    assert "Number of steps must be less than 100" in str(errors[1])


@pytest.mark.parametrize(
    "placements", [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Partial())]
)
def test_tensor_parallel_params_are_refused_by_name(placements: tuple) -> None:
    """torch.optim.Muon accepts them (and runs Newton-Schulz on DTensors); ours does not
    do tensor parallelism and says so at construction, naming the parameter."""
    with fake_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        param = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, placements))
        torch.optim.Muon([param])
        with pytest.raises(NotImplementedError, match=r"'tp_weight'.*torch\.optim\.Muon"):
            Muon([("tp_weight", param)])


def test_fsdp_and_hsdp_params_are_accepted() -> None:
    with fake_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, (Replicate(), Shard(0))))
        fsdp = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["shard"], (Shard(1),)))
        assert len(Muon([hsdp, fsdp]).param_groups[0]["params"]) == 2


# ---------------------------------------------------------------------------
# Owners and the all-to-all plan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "world_size"), [(65, 4), (65, 2), (3, 4), (5, 4), (64, 4)])
def test_chunks_are_torch_chunk(rows: int, world_size: int) -> None:
    """DTensor's Shard(0) is torch.chunk, with empty chunks for the trailing ranks."""
    whole = torch.arange(rows * 3.0).view(rows, 3)
    matrix = ShardedMatrix(whole.shape, 0)
    expected = list(whole.chunk(world_size))
    expected += [whole[:0]] * (world_size - len(expected))
    got = matrix.chunks(whole, world_size)
    assert [tuple(c.shape) for c in got] == [tuple(c.shape) for c in expected]
    assert [matrix.chunk_numel(world_size, r) for r in range(world_size)] == [
        c.numel() for c in expected
    ]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_assign_owners_largest_first_to_least_loaded() -> None:
    # Costs by size: 9 -> rank 0; 7 -> 1; 5 -> 2; 4 -> 2 (loads 9, 7, 5); the first 3 -> 1
    # (loads 9, 7, 9); the second 3 -> 0 (loads 9, 10, 9: the lower rank wins the tie).
    assert assign_owners([3, 9, 4, 7, 5, 3], 3) == (1, 0, 2, 1, 2, 0)
    assert assign_owners([1.0] * 4, 4) == (0, 1, 2, 3)
    assert assign_owners([2.0, 1.0], 4) == (0, 1)  # ranks 2 and 3 own nothing


def test_plan_splits_mirror_each_other() -> None:
    """What rank s sends owner o in the gather is what o receives from s, and the
    scatter sends it back: check over every (s, o) pair for uneven chunks."""
    matrices = [ShardedMatrix(torch.Size(s), 0) for s in [(65, 24), (40, 65), (3, 40), (7, 3)]]
    costs = [float(m.shape.numel()) for m in matrices]
    world_size = 4
    plans = [plan_owners(matrices, costs, world_size, r) for r in range(world_size)]
    assert len({p.owners for p in plans}) == 1
    for source, plan in enumerate(plans):
        for owner in range(world_size):
            assert plan.send_splits()[owner] == plans[owner].recv_splits()[source]
    total = sum(m.shape.numel() for m in matrices)
    assert sum(sum(p.send_splits()) for p in plans) == total
    assert isinstance(plans[0], OwnerPlan) and sorted(set(plans[0].owners)) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)


@pytest.mark.parametrize("tied", [False, True])
def test_split_muon_params_on_llama(tied: bool) -> None:
    model = Llama(dataclasses.replace(CONFIG, tie_embeddings=tied))
    muon, other = split_muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for p in muon)
    other_names = sorted(names[id(p)] for p in other)
    blocks = [
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
        + ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    ]
    assert muon_names == sorted(blocks)
    assert "tok_embeddings.weight" in other_names and "norm.weight" in other_names
    assert ("output.weight" in other_names) is not tied  # tied: the embedding itself
    assert len(muon) + len(other) == len(list(model.parameters()))


def test_split_muon_params_exclude_and_frozen() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    muon, other = split_muon_params(model, exclude=("1",))
    assert muon == [] and other == [model[0].bias, model[1].weight, model[1].bias]
    muon, other = split_muon_params(model, exclude=())
    assert muon == [model[1].weight]


def test_bf16_momentum_buffer_is_not_normalized_in_place() -> None:
    """A deliberate difference: with bf16 params and ``nesterov=False`` torch 2.13's
    Muon hands the momentum buffer itself to Newton-Schulz, whose ``.bfloat16()`` is then
    a no-op and whose ``div_`` normalizes the buffer in place (its norm becomes 1). Ours
    copies first, so the buffer stays ``(1 - momentum) * grad`` after the first step."""
    gen = torch.Generator().manual_seed(3)
    param = nn.Parameter(torch.randn(4, 3, generator=gen).bfloat16())
    param.grad = (torch.randn(4, 3, generator=gen) * 10).bfloat16()
    optimizer = Muon([param], nesterov=False, momentum=0.5)
    optimizer.step()
    expected = torch.zeros_like(param.grad).lerp_(param.grad, 0.5)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], expected)
