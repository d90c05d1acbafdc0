"""kvikio's thread pool is sized from IOConfig.threads (its default is one thread), and
device memory moves on the caller's stream.

kvikio cannot run here (it needs libcuda), so a stand-in module records the calls;
both spellings of the setting, by kvikio release, are covered.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from storage.io import IOConfig, KvikioBackend, aligned_empty, size_kvikio_threads


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


class _FakeCuFile:
    """Reads and writes the file for real; records which kvikio call moved the bytes."""

    calls: ClassVar[list[tuple[object, ...]]] = []

    def __init__(self, path: str, flags: str) -> None:
        self.path = path
        if flags == "w":
            open(path, "wb").close()

    def _read(self, buf: Any, size: int, offset: int) -> int:
        with open(self.path, "rb") as f:
            f.seek(offset)
            buf[:size] = np.frombuffer(f.read(size), dtype=np.uint8)
        return size

    def _write(self, buf: Any, size: int, offset: int) -> int:
        with open(self.path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(buf[:size]))
        return size

    def pread(self, buf: Any, size: int, offset: int, task_size: int) -> Any:
        _FakeCuFile.calls.append(("pread", size, offset))
        return SimpleNamespace(get=lambda: self._read(buf, size, offset))

    def pwrite(self, buf: Any, size: int, offset: int, task_size: int) -> Any:
        _FakeCuFile.calls.append(("pwrite", size, offset))
        return SimpleNamespace(get=lambda: self._write(buf, size, offset))

    def raw_read_async(self, buf: Any, stream: int, size: int, offset: int) -> Any:
        _FakeCuFile.calls.append(("raw_read_async", stream, size, offset))
        return SimpleNamespace(check_bytes_done=lambda: self._read(buf, size, offset))

    def raw_write_async(self, buf: Any, stream: int, size: int, offset: int) -> Any:
        _FakeCuFile.calls.append(("raw_write_async", stream, size, offset))
        return SimpleNamespace(check_bytes_done=lambda: self._write(buf, size, offset))

    def fileno(self) -> int:
        return os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        pass


def test_device_memory_moves_on_the_callers_stream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A read into (write from) CUDA memory goes through kvikio's stream-ordered calls on
    the caller's current stream, never pread/pwrite (which synchronise the device's
    default stream first, making each direct page-in wait for the queued compute); host
    memory keeps kvikio's thread pool. CUDA cannot run here: the buffer's stream is faked
    (77), the bytes go through the file for real."""
    module = _fake(SimpleNamespace(set=lambda _: None))
    module.CuFile = _FakeCuFile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    backend = KvikioBackend(IOConfig(backend="kvikio", threads=2))
    path = tmp_path / "chunk"
    data = torch.arange(3 * 1024, dtype=torch.int32).view(torch.uint8)  # 3 blocks
    try:
        _FakeCuFile.calls = []
        src = aligned_empty(data.numel())
        src[: data.numel()] = data
        assert backend.write_async(path, src, data.numel(), fsync=False).wait() == data.numel()
        out = aligned_empty(data.numel())
        assert backend.read_async(path, out, 4096, offset=4096).wait() == 4096
        assert _FakeCuFile.calls == [("pwrite", data.numel(), 0), ("pread", 4096, 4096)]
        assert torch.equal(out[:4096], data[4096:8192])

        monkeypatch.setattr(KvikioBackend, "_device_stream", staticmethod(lambda b: 77), False)
        _FakeCuFile.calls = []
        out.zero_()
        assert backend.write_async(path, src, data.numel(), fsync=False).wait() == data.numel()
        assert backend.read_async(path, out, 8192, offset=4096).wait() == 8192
        assert _FakeCuFile.calls == [
            ("raw_write_async", 77, data.numel(), 0),
            ("raw_read_async", 77, 8192, 4096),
        ]
        assert torch.equal(out[:8192], data[4096:12288])
    finally:
        backend.close()
