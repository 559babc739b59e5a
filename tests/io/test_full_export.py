"""``save_full_state_dict``'s safetensors file against torch's route to one, on 2 gloo
ranks (one spawn).

torch has no streamed export: its route to a full safetensors file is
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on its ``fully_shard``
and ``safetensors.torch.save_file`` on rank 0. Both start from one Hugging Face
``LlamaForCausalLM`` (tiny config, no download; bf16 untied and fp32 tied embeddings):

- the two files hold the same names, dtypes, shapes and bytes, read by
  ``safetensors.torch.load_file``, and both equal the unsharded model's state dict;
- ``LlamaForCausalLM.from_pretrained`` on a directory of ``config.json`` and our file
  rebuilds the model bit for bit.

Memory: rank 0's peak resident set above the start of the export (``VmHWM``, reset
through ``/proc/self/clear_refs``), with glibc mapping every block of 1 MiB or more on
its own and unmapping it when freed (``MALLOC_MMAP_THRESHOLD_``), so the resident set
follows the live tensors. Ours holds about one gathered tensor (gloo's all-gather keeps
a second buffer of its size while it runs), torch's route the whole model.
"""

import copy
import importlib.util
import os
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard, save_full_state_dict
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests.integrations.test_hf_models import _build, _shard
from tests.io.test_full_state_dict_file import same_bits

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs transformers and peft (the [test] extra)",
)

WORLD_SIZE = 2
VARIANTS = {"untied": torch.bfloat16, "tied": torch.float32}
LAYERS, DIM = 16, 1024  # the memory model: 16 x 4 MiB fp32 weights
MMAP_THRESHOLD = 1 << 20


def _torch_route(model: nn.Module, path: str) -> None:
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        # save_file refuses tensors that share memory (tied embeddings): copy the second.
        seen: set[int] = set()
        for key, value in full.items():
            if value.data_ptr() in seen:
                full[key] = value.clone()
            seen.add(value.data_ptr())
        safetensors.torch.save_file(full, path, metadata={"format": "pt"})
    dist.barrier()


def _hf(variant: str, directory: str) -> dict[str, Any] | None:
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    base = _build(variant).to(VARIANTS[variant])
    ours_dir = os.path.join(directory, f"{variant}_ours")
    ours_path = os.path.join(ours_dir, "model.safetensors")
    torch_path = os.path.join(directory, f"{variant}_torch.safetensors")
    if dist.get_rank() == 0:
        base.config.save_pretrained(ours_dir)
    dist.barrier()
    save_full_state_dict(_shard(copy.deepcopy(base), mesh, fully_shard), ours_path)
    _torch_route(_shard(copy.deepcopy(base), mesh, torch_fully_shard), torch_path)
    if dist.get_rank() != 0:
        return None
    pretrained = LlamaForCausalLM.from_pretrained(ours_dir, dtype=VARIANTS[variant])
    return {
        "unsharded": {k: v.clone() for k, v in base.state_dict().items()},
        "ours": safetensors.torch.load_file(ours_path),
        "torch": safetensors.torch.load_file(torch_path),
        "pretrained": {k: v.clone() for k, v in pretrained.state_dict().items()},
    }


def _vm_hwm() -> int:
    with open("/proc/self/status") as status:
        return int(next(x for x in status if x.startswith("VmHWM:")).split()[1]) * 1024


def _peak_rss_above_start(fn: Any) -> int:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak resident set becomes the current one
    start = _vm_hwm()
    fn()
    return _vm_hwm() - start


def _memory(directory: str) -> dict[str, int] | None:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    peaks = {}
    for name, shard, export in (
        ("ours", fully_shard, save_full_state_dict),
        ("torch", torch_fully_shard, _torch_route),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)))
        for layer in model:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        path = os.path.join(directory, f"memory_{name}.safetensors")
        peaks[name] = _peak_rss_above_start(lambda: export(model, path))
        del model
    return peaks if dist.get_rank() == 0 else None


def _worker(rank: int, world_size: int, directory: str) -> dict:
    return run_scenarios(
        {
            **{v: (lambda v=v: _hf(v, directory)) for v in VARIANTS},
            "memory": lambda: _memory(directory),
        }
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("full_export"))
    with pytest.MonkeyPatch.context() as patch:
        # Read at process start: these ranks are spawned for this file, not the pool's.
        patch.setenv("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
        return run_distributed(_worker, WORLD_SIZE, directory)


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose dtype, shape or bytes differ, or that only one side has."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not same_bits(a[k], b[k])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_equals_torch_route_and_loads_into_transformers(run: list[dict], variant: str) -> None:
    rec = scenario_records(run, variant)[0]
    assert len(rec["ours"]) > 10 and {v.dtype for v in rec["ours"].values()} == {VARIANTS[variant]}
    assert _differences(rec["ours"], rec["torch"]) == []
    assert _differences(rec["ours"], rec["unsharded"]) == []
    assert _differences(rec["pretrained"], rec["unsharded"]) == []


def test_export_peak_memory_is_one_tensor_not_the_model(run: list[dict]) -> None:
    peaks = scenario_records(run, "memory")[0]
    tensor = DIM * DIM * 4
    model = LAYERS * tensor
    # Ours: the gathered tensor and gloo's second buffer of its size during the
    # all-gather (2 tensors), with half a tensor of slack for the interpreter's own pages.
    assert peaks["ours"] <= 2.5 * tensor, peaks
    assert peaks["torch"] >= model, peaks
