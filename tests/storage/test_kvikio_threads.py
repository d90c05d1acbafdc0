"""kvikio's thread pool is sized from IOConfig.threads (its default is one thread).

kvikio cannot run here (it needs libcuda), so a stand-in module records the calls;
both spellings of the setting, by kvikio release, are covered.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from storage.io import IOConfig, KvikioBackend, size_kvikio_threads


def _fake(defaults: Any) -> ModuleType:
    module = ModuleType("kvikio")
    module.defaults = defaults  # type: ignore[attr-defined]
    return module


def test_backend_sets_the_pool_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, int]] = []
    monkeypatch.setitem(sys.modules, "kvikio", _fake(SimpleNamespace(set=calls.append)))
    backend = KvikioBackend(IOConfig(backend="kvikio", threads=6))
    try:
        assert calls == [{"num_threads": 6}]
    finally:
        backend.close()


def test_older_kvikio_spelling_and_a_missing_setting() -> None:
    calls: list[int] = []
    size_kvikio_threads(_fake(SimpleNamespace(num_threads_reset=calls.append)), 3)
    assert calls == [3]
    with pytest.raises(ValueError, match=r"neither defaults\.set nor defaults\.num_threads_reset"):
        size_kvikio_threads(_fake(SimpleNamespace()), 3)
