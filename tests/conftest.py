"""Shared pytest configuration.

``--fsdp-impl`` picks the ``fully_shard`` that the tests exercise: ``ours`` (the
default, ``dtensor_fsdp``) or ``torch`` (``torch.distributed.fsdp``), which checks the
tests themselves against the implementation we copy.
"""

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fsdp-impl",
        choices=("ours", "torch"),
        default="ours",
        help="fully_shard implementation under test: ours (dtensor_fsdp) or torch's",
    )


@pytest.fixture(scope="session")
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fsdp-impl")
