"""Shared pytest configuration: the implementation under test, the two tiers, the pool.

``--fsdp-impl`` picks the ``fully_shard`` that the tests exercise: ``ours`` (the
default, ``dtensor_fsdp``) or ``torch`` (``torch.distributed.fsdp``), which checks the
tests themselves against the implementation we copy.

Tiers (docs/testing.md): ``python -m pytest tests`` runs everything; ``-m "not full"``
is the fast tier to run while developing. A test is ``full`` when its file is in
`FULL_PATHS`, when its module uses tests/_torchrun.py's launcher, or when it carries
the mark itself (a file whose spawns are 4 ranks, a 4-rank fixture parameter). The
harness enforces it: a test outside ``full`` that spawns 4 ranks, launches torchrun or
compiles with inductor fails, naming the fix (tests/_harness.py, `require_full`).

``gloo_pool``: the session's reusable gloo ranks, 2 or 4 (tests/_pool.py).
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Bytecode caches, before the first import of dtensor_fsdp: where the environment turns
# their writing off (PYTHONDONTWRITEBYTECODE), every rank, pool worker, torchrun child
# and subprocess of the session would compile dtensor_fsdp and the test modules from
# source again (~0.4 CPU-s each). Spawned ranks still get ``-B`` from this process's
# start-up flags: they read what this process and the torchrun children wrote.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tests import _harness, _torchrun  # noqa: E402
from tests._pool import GlooPools  # noqa: E402

TESTS = Path(__file__).parent

# What is ``full`` by path, relative to tests/: a folder ("x/"), a file, or one test
# ("file.py::test"). The fast tier keeps the in-process tests and one 2-rank gloo
# parity file per behaviour, the list of docs/testing.md: test_training (2 ranks),
# comm/test_comm, test_mixed_precision, test_accumulation, io/test_state_dict (one
# world size), observe/test_checks, optim/test_optim_local_shards_gloo (2 ranks),
# graph/test_graph_numerics on aot_eager, post_training/test_stream_weights, and the
# gradient-level comparisons with torch of runtime/scenarios that guard the lifecycle
# (list groups, autograd, comm, frozen, mixed precision, registration). Every other test
# that starts processes is here.
FULL_PATHS = (
    # Fresh interpreters (subprocess) and the GPU check's own ranks.
    "api/test_default_process_group.py",
    "api/test_fake_backend.py",
    "plan/test_peak_module.py",
    "plan/test_plan.py::test_cli_tiny_json",
    "tools/test_gpu_check.py::test_skips_cleanly_without_cuda",
    "tools/test_gpu_check.py::test_nothing_imported_needs_expecttest",
    "tools/test_gpu_check.py::test_a_hung_or_raising_row_is_stopped",
    "tools/test_gpu_check.py::test_a_mismatching_study_fails",
    "tools/test_gpu_check.py::test_gloo_row_on_cpu_tensors",
    # Ranks of their own: 1, 3 or 4, or 2 beyond the fast tier's parity files.
    "comm_precision/test_comm_precision.py",
    "comm_precision/test_comm_precision_checkpoint.py",
    "comm_precision/test_comm_precision_combos.py",
    "graph/test_conformance.py",  # 4 ranks
    "graph/test_graph_features.py",
    "graph/test_graph_numerics.py::test_inductor_is_as_close_to_eager_as_the_plain_model",
    "graph/test_graph_numerics.py::test_hsdp_and_tensor_parallel_train_bitwise_like_eager",
    "graph/test_graph_pipeline.py",
    "graph/test_graph_structure.py",
    "init/test_meta_init.py",
    "init/test_meta_init_bounded.py",
    "init/test_meta_load_assign.py",
    "integrations/",  # real frameworks, torchrun jobs, pipelines, compile
    "io/test_async_save.py",
    "io/test_checkpoint_agreement.py",
    "io/test_full_export.py",
    "io/test_state_dict_submodule.py",
    "optim/test_clip_grad_norm_gloo.py",
    "optim/test_muon_gloo.py",
    "optim/test_torch_clip_and_grad_scaler.py",
    "plan/test_auto_shard_gloo.py",
    "plan/test_plan_gloo.py",
    "plan/test_plan_gloo_reduce_scatter.py",
    "post_training/test_engine_broadcast.py",  # 3 ranks
    "post_training/test_generate.py",
    "post_training/test_offload_states.py",
    "post_training/test_stream_lora.py",
    "runtime/comm/test_backends.py",
    "runtime/comm/test_comm_settings.py",
    "runtime/comm/test_list_group_prefetch.py",
    "runtime/comm/test_setters.py",
    "runtime/mesh/test_hsdp.py",
    "runtime/mesh/test_multi_mesh.py",
    "runtime/mesh/test_spmd.py",
    "runtime/mesh/test_tp.py",
    "runtime/scenarios/test_scenarios_2d.py",
    "runtime/scenarios/test_scenarios_compose.py",
    "runtime/scenarios/test_scenarios_init.py",
    "runtime/scenarios/test_scenarios_module_api.py",
    "runtime/scenarios/test_scenarios_state_dict.py",
    "runtime/scenarios/test_scenarios_training.py",
    "runtime/streams/test_deferred_streams.py",
    "runtime/streams/test_streams.py",
    "runtime/test_all_gather_extensions.py",
    "runtime/test_cpu_offload.py",
    "runtime/test_host.py",
    "runtime/test_incomplete_list_group.py",
    "runtime/test_memory.py",
    "runtime/test_param_kinds.py",
    "runtime/test_post_backward_per_forward.py",
    "runtime/test_replaced_param.py",
    "runtime/test_step_features.py",
    "runtime/test_world_size_one.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fsdp-impl",
        choices=("ours", "torch"),
        default="ours",
        help="fully_shard implementation under test: ours (dtensor_fsdp) or torch's",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "full: only in the full suite (torchrun, inductor, 4 ranks); "
        '-m "not full" is the fast tier (docs/testing.md)',
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_full(item):
            item.add_marker(pytest.mark.full)


def _is_full(item: pytest.Item) -> bool:
    path = Path(item.path).relative_to(TESTS).as_posix()
    test = f"{path}::{item.name.split('[')[0]}"
    if any(p in (path, test) or (p.endswith("/") and path.startswith(p)) for p in FULL_PATHS):
        return True
    # A module that imported the torchrun launcher launches jobs with it.
    module = getattr(item, "module", None)
    return module is not None and any(
        value is _torchrun.torchrun for value in vars(module).values()
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the fixtures: a module-scoped fixture's spawn is checked against the
    # first test that sets it up (they share its marks when they share the fixture).
    _harness.set_running_test(item.nodeid, item.get_closest_marker("full") is not None)


@pytest.fixture(autouse=True)
def _no_inductor_in_the_fast_tier() -> Iterator[None]:
    """Inductor compiles in this process (the ranks' are checked by the harness)."""
    yield
    _harness.check_no_inductor_compile()


@pytest.fixture(scope="session")
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fsdp-impl")


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[GlooPools]:
    """The session's reusable gloo ranks, 2 or 4 of them (tests/_pool.py): pass it to
    ``run_distributed(..., pool=gloo_pool)``."""
    pools = GlooPools()
    yield pools
    pools.close()
