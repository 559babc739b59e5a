"""``dtensor_fsdp.optim.clip_grad_norm_`` in one process: plain tensors against
``torch.nn.utils.clip_grad_norm_``, errors, and on torch's ``fake`` process group
(collectives return their input) which ranks count which grad and over which group the
one all-reduce runs ([Note: sharded grad norm]). Real multi-rank parity with torch's
function: tests/optim/test_clip_grad_norm_gloo.py.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtensor_fsdp.optim import clip_grad_norm_, get_total_norm
from dtensor_fsdp.optim.clip import _reduce_groups
from tests._harness import fake_mesh


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((4, 3), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, 0.0])
@pytest.mark.parametrize("foreach", [None, False])
def test_plain_tensors_match_torch(norm_type: float, foreach: bool | None) -> None:
    ours, theirs = _params(0), _params(0)
    norm = clip_grad_norm_(ours, 0.5, norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type, foreach=foreach)
    assert type(norm) is torch.Tensor and norm.dtype == expected.dtype
    # The same terms, combined in another order: a few fp32 ulps.
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=0)


def test_single_tensor_and_empty() -> None:
    (p, *_), (q, *_) = _params(1), _params(1)
    torch.testing.assert_close(
        clip_grad_norm_(p, 0.1), torch.nn.utils.clip_grad_norm_(q, 0.1), rtol=1e-6, atol=0
    )
    assert torch.equal(clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip_grad_norm_((p for p in []), 1.0)
    assert any("empty generator" in str(w.message) for w in caught)


def test_nonfinite_error_matches_torch() -> None:
    ours, theirs = _params(2), _params(2)
    for params in (ours, theirs):
        params[1].grad[0] = float("inf")
    with pytest.raises(RuntimeError) as expected:
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as raised:
        clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    assert str(raised.value) == str(expected.value)


def test_foreach_on_unsupported_device_matches_torch() -> None:
    params = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    params[0].grad = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True was passed") as expected:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    with pytest.raises(RuntimeError) as raised:
        clip_grad_norm_(params, 1.0, foreach=True)
    assert str(raised.value) == str(expected.value)


def test_partial_grad_is_refused() -> None:
    with fake_mesh(2) as mesh:
        grad = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()], run_check=False)
        with pytest.raises(ValueError, match="Partial"):
            get_total_norm([grad])


def test_replicated_grads_counted_once_per_reduced_axis() -> None:
    """(dp, tp) = (2, 2), fake rank 1 = coordinate (0, 1). With a (Shard, Shard) grad
    the all-reduce (an identity here) runs over both axes, so a (Shard, Replicate) grad
    (a TP-replicated norm) is counted at tp coordinate 0 only; alone, it is reduced
    over dp only and counted on every rank."""
    with fake_mesh(4, rank=1):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert tuple(mesh.get_coordinate()) == (0, 1)
        sharded = DTensor.from_local(torch.full((2, 2), 3.0), mesh, [Shard(0), Shard(1)])
        norm_weight = DTensor.from_local(torch.full((4,), 5.0), mesh, [Shard(0), Replicate()])
        total = get_total_norm([sharded, norm_weight])
        assert total.to_local().item() == pytest.approx(math.sqrt(4 * 9.0))  # only `sharded`
        assert get_total_norm([norm_weight]).to_local().item() == pytest.approx(10.0)
        assert get_total_norm([sharded, norm_weight], math.inf).to_local().item() == 3.0
        assert get_total_norm([norm_weight], math.inf).to_local().item() == 5.0


def test_reduce_groups() -> None:
    """One group for the union of sharded axes: an axis's own group, the world, or a
    flattened sub-mesh; one per axis only for a mesh without axis names."""
    with fake_mesh(8):
        named = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        assert _reduce_groups(named, set()) == []
        assert _reduce_groups(named, {1}) == [named.get_group(1)]
        assert _reduce_groups(named, {0, 1, 2}) == [dist.group.WORLD]
        (flattened,) = _reduce_groups(named, {1, 2})
        assert dist.get_world_size(flattened) == 4
        unnamed = init_device_mesh("cpu", (2, 2, 2))
        assert _reduce_groups(unnamed, {1, 2}) == [unnamed.get_group(1), unnamed.get_group(2)]
