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
