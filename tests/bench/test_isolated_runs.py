"""The benchmarks time each run in a child process of its own (``_common.isolated``)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
MIB = 1 << 20


def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_common")


def test_a_run_starts_without_this_process_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    module = common(monkeypatch)
    ballast = torch.ones(128 * MIB // 4)  # 128 MiB touched in this process
    here = module.rss()
    assert module.isolated(os.getpid) != os.getpid()
    child_rss = module.isolated(module.rss)
    assert child_rss < here - 64 * MIB, (child_rss / MIB, here / MIB)
    assert float(ballast.sum()) == ballast.numel()


def test_an_error_in_the_run_is_raised_here(monkeypatch: pytest.MonkeyPatch) -> None:
    module = common(monkeypatch)
    with pytest.raises(ValueError, match="invalid literal"):
        module.isolated(int, "not a number")
