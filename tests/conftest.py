"""Options shared by the whole suite: ``--cuda-double`` runs every store under the CPU
double of CUDA's copy semantics (:mod:`storage.deferred`)."""

from __future__ import annotations

import os

import pytest

from storage.deferred import DOUBLE_ENV


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cuda-double",
        action="store_true",
        help=f"run every TieredStore on a CPU device under the CPU double of CUDA's copy "
        f"semantics (sets {DOUBLE_ENV}=1, inherited by subprocesses)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--cuda-double"):
        os.environ[DOUBLE_ENV] = "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked ``slow`` first, each group in its collected order: the two
    xdist workers, which take each other's queued tests when idle, then end on short tests
    instead of one of them waiting for a minute-long test that another started last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
