"""Options shared by the whole suite: ``--cuda-double`` runs every store under the CPU
double of CUDA's copy semantics (:mod:`storage.deferred`). Every test, and every process
a test starts, keeps the probes' caches (``$BB_CACHE_DIR``) and the compiled kernels
(``$BB_NATIVE_DIR``) in a directory of this pytest run, never the user's
``~/.cache/balance_beam``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bb_lightning.engine.native import NATIVE_DIR_ENV
from bb_lightning.probe.measure import CACHE_ENV
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


@pytest.fixture(scope="session", autouse=True)
def probe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``$BB_CACHE_DIR`` (and ``$BB_NATIVE_DIR`` in it) for the whole run: one directory
    every xdist worker of this pytest run shares (a hardware profile measured once, a kernel
    built once, serve them all), set in ``os.environ`` so that subprocesses inherit it; the
    values before are restored at the end."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bb-cache"
    root.mkdir(parents=True, exist_ok=True)
    values = {CACHE_ENV: str(root), NATIVE_DIR_ENV: str(root / "native")}
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)  # a test's own $BB_CACHE_DIR still shares the kernels built
    try:
        yield str(root)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
