"""``python tools/quant_error.py``: the block-size tool (one process, no group).

Not a comparison with torch's fully_shard: the tool simulates our own wire format
(CommPrecisionPolicy has no torch counterpart). Its sharded error is checked against
``wire_format.quantization_error`` on each shard separately, the codec's own reference.
"""

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dtensor_fsdp.comm_precision.wire_format import quantization_error


def _load_tool():
    """tools/quant_error.py, a script outside the package, imported by path."""
    path = Path(__file__).resolve().parents[2] / "tools" / "quant_error.py"
    spec = importlib.util.spec_from_file_location("quant_error", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quant_error"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


quant_error = _load_tool()

# A one-block, dim-64 Llama on 16 tokens: main() runs in well under a second.
TINY = ["--dim", "64", "--n-layers", "1", "--seq-len", "16", "--batch-size", "1"]
TINY += ["--world-size", "2", "--block-sizes", "64,256"]


def _tiny_report() -> tuple[torch.nn.Module, quant_error.QuantErrorReport]:
    args = quant_error.parse_args(TINY)
    model = quant_error.build_model(args)
    quant_error.compute_grads(model, args.batch_size, args.seed)
    schemes = quant_error.schemes_for(args.formats, args.block_sizes)
    return model, quant_error.measure(model, args.world_size, schemes)


def test_main_prints_every_parameter_and_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    quant_error.main(TINY)
    out = capsys.readouterr().out
    model = quant_error.build_model(quant_error.parse_args(TINY))
    lines = out.splitlines()
    for fqn, param in model.named_parameters():
        rows = [line for line in lines if line.split(" ", 1)[0] == fqn]
        # Once in the weights table, once in the grads table, each with its shape.
        assert len(rows) == 2, fqn
        assert all("x".join(map(str, param.shape)) in row for row in rows), fqn
    summary = lines[lines.index(next(l for l in lines if l.startswith("summary"))) :]
    for label in ("int8@64", "int8@256", "fp8_e4m3@64", "fp8_e4m3@256", "bf16"):
        assert any(line.startswith(label + " ") for line in summary), label


def test_int8_error_on_normal_weights() -> None:
    # init_weights draws N(0, 0.02) matrices. int8 at block 64: the step is
    # absmax / 127 ~ 2.5 sigma / 127, rounding error RMS step / sqrt(12): ~0.6% relative.
    # An exact round trip (0) would mean nothing was quantized.
    model, report = _tiny_report()
    index = report.schemes.index(quant_error.Scheme("int8", 64))
    matrices = [p for p in report.params if p.is_quantized_by_default]
    assert len(matrices) == sum(1 for p in model.parameters() if p.ndim >= 2)
    for p in matrices:
        assert 0.0 < p.weight_errors[index] < 0.01, p.fqn
        assert 0.0 < p.grad_errors[index] < 0.01, p.fqn


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_error_quantizes_each_shard_alone(world_size: int) -> None:
    # Rows of very different magnitudes: one block across shards would share the big
    # scale and the error would differ. 7 rows: shards are padded (ceil(7 / W) rows each).
    torch.manual_seed(0)
    x = torch.randn(7, 24) * torch.logspace(-3, 0, 7).unsqueeze(1)  # (7, 24)
    error, nbytes = quant_error.sharded_quantization_error(x, "int8", 8, world_size)
    rows = math.ceil(7 / world_size)
    shards = [s for s in x.split(rows) if s.numel()]
    squared = sum(
        (quantization_error(s, "int8", 8) * torch.linalg.vector_norm(s.double()).item()) ** 2
        for s in shards
    )
    expected = math.sqrt(squared) / torch.linalg.vector_norm(x.double()).item()
    # Same codec on the same values; only the float64 norm summation order differs.
    assert error == pytest.approx(expected, rel=1e-9)
    blocks = math.ceil(rows * 24 / 8)
    assert nbytes == world_size * (blocks * 8 + 4 * blocks)  # codes + fp32 scales per row


def test_smaller_blocks_track_outliers_better() -> None:
    # A few 100x outliers: a block holding one scales its neighbours' step up 100x, so
    # the fewer elements share a block, the fewer are hurt.
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    x.view(-1)[torch.randint(x.numel(), (40,))] *= 100.0
    errors = [
        quant_error.sharded_quantization_error(x, "int8", block_size, 4)[0]
        for block_size in (16, 64, 256, 1024)
    ]
    assert errors == sorted(errors)
    assert errors[0] < errors[-1] / 2


def test_bad_block_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        quant_error.parse_args(["--block-sizes", "64,30"])
    assert "multiples of 4" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["torch_save", "dcp_dir"])
def test_checkpoint_is_loaded(tmp_path, kind: str) -> None:
    # Weights from another seed, saved the two ways the tool reads: a torch.save'd
    # {"model": state dict} file, or a DCP directory as train.py's checkpoints are.
    saved = quant_error.build_model(quant_error.parse_args([*TINY, "--seed", "7"]))
    state = {"model": saved.state_dict()}
    path = str(tmp_path / ("model.pt" if kind == "torch_save" else "step"))
    if kind == "torch_save":
        torch.save(state, path)
    else:
        with warnings.catch_warnings():  # "assuming ... a single process": intended here
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=path, no_dist=True)
    loaded = quant_error.build_model(quant_error.parse_args([*TINY, "--checkpoint", path]))
    fresh = quant_error.build_model(quant_error.parse_args(TINY))
    for (name, a), b, c in zip(
        loaded.named_parameters(), saved.parameters(), fresh.parameters(), strict=True
    ):
        assert torch.equal(a, b), name  # bytes copied, no arithmetic
    assert not torch.equal(loaded.output.weight, fresh.output.weight)
