"""Fixtures of the engine's tests."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from bb_lightning.engine import attention, native


def built_kernel() -> native.NativeAttention:
    """The compiled decode attention kernel, which must build and be used where the machine
    has a C compiler and AVX-512; the test is skipped elsewhere (torch's products serve it
    there)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH: decode attention runs torch's products")
    if "avx512f" not in native._cpu_signature().split():
        pytest.skip("no AVX-512 on this machine: decode attention runs torch's products")
    kern = native.kernel()
    assert kern is not None, "the C kernel did not build (see the warning)"
    return kern


@pytest.fixture
def kernel() -> native.NativeAttention:
    """:func:`built_kernel` as a fixture."""
    return built_kernel()


@pytest.fixture
def record_chunks(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], list[str]]:
    """``record(path)`` runs CPU decode attention's chunks on ``path`` ("native": the
    compiled kernel on the pool's workers, which must have built; "torch": torch's
    products) and returns the list the names of the threads each chunk ran on go to."""

    def record(path: str) -> list[str]:
        names: list[str] = []
        target: Any
        if path == "native":
            monkeypatch.setattr(built_kernel(), "team", False)  # chunks, not torch's team
            target, name = native.NativeAttention, "attend"
        else:
            monkeypatch.setattr(attention, "kernel", lambda: None)
            target, name = attention, "_attend"
        run = getattr(target, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            names.append(threading.current_thread().name)
            return run(*args, **kwargs)

        monkeypatch.setattr(target, name, recorded)
        return names

    return record


def count_function_calls(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, method: str
) -> list[int]:
    """Replace the autograd ``Function`` ``owner.name`` with a subclass whose ``method``
    (``"forward"`` or ``"backward"``) appends to the list returned, then runs the class's."""
    calls: list[int] = []
    kind = getattr(owner, name)

    def counted(ctx: Any, *args: Any) -> Any:
        calls.append(1)
        return getattr(kind, method)(ctx, *args)

    monkeypatch.setattr(
        owner, name, type(f"Counted{name}", (kind,), {method: staticmethod(counted)})
    )
    return calls


def thread_count(request: pytest.FixtureRequest, team: bool) -> Iterator[int]:
    """Run the test at ``request.param`` torch threads, put back after it; skipped above one
    where the kernel under test runs on one thread (``team`` false: no shared OpenMP team)."""
    if request.param > 1 and not team:
        pytest.skip("the kernel runs on one thread here (no shared OpenMP team)")
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
