"""The I/O backends: one suite for both, checked against plain Python file I/O."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import storage.io as sio
from storage.io import (
    ALIGNMENT,
    BACKEND_ENV,
    IOBackend,
    IOConfig,
    IOFuture,
    aligned_empty,
    kvikio_status,
    open_backend,
    padded,
)

SIZES = [0, 1, 4095, 4096, 4097, (3 << 20) + 123]


@pytest.fixture(params=["posix", pytest.param("kvikio", marks=pytest.mark.kvikio)])
def backend(request: pytest.FixtureRequest) -> Iterator[IOBackend]:
    name = request.param
    if name == "kvikio":
        usable, reason = kvikio_status()
        if not usable:
            pytest.skip(f"kvikio backend cannot run here: {reason}")
    b = open_backend(IOConfig(backend=name, threads=3, task_size=64 << 10))
    assert b.name == name
    yield b
    b.close()


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def filled(data: torch.Tensor) -> torch.Tensor:
    buf = aligned_empty(data.numel())
    buf.fill_(0xEE)  # junk past the end must never reach the file
    buf[: data.numel()] = data
    return buf


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_matches_plain_file_io(backend: IOBackend, tmp_path: Path, n: int) -> None:
    data = random_bytes(n, seed=n)
    path = tmp_path / "blob.bin"
    assert backend.write_async(path, filled(data), n).wait() == n
    assert path.read_bytes() == data.numpy().tobytes()  # independent reference
    dst = aligned_empty(n)
    assert backend.read_async(path, dst, n).wait() == n
    assert torch.equal(dst[:n], data)


def test_reads_file_written_by_python(backend: IOBackend, tmp_path: Path) -> None:
    data = random_bytes(200_003, seed=7)
    path = tmp_path / "py.bin"
    path.write_bytes(data.numpy().tobytes() + b"tail")
    dst = aligned_empty(data.numel())
    backend.read_async(path, dst, data.numel()).wait()
    assert torch.equal(dst[: data.numel()], data)


def test_write_truncates_longer_file(backend: IOBackend, tmp_path: Path) -> None:
    path = tmp_path / "old.bin"
    path.write_bytes(b"x" * 100_000)
    backend.write_async(path, filled(random_bytes(10)), 10).wait()
    assert path.stat().st_size == 10


@pytest.mark.parametrize("size, n", [(3 * 4096, 4096), (10_000, 10_000)])
def test_in_place_write_goes_over_the_file_without_truncating_it(
    backend: IOBackend, tmp_path: Path, size: int, n: int
) -> None:
    old = random_bytes(size, seed=1)
    path = tmp_path / "old.bin"
    path.write_bytes(old.numpy().tobytes())
    inode = path.stat().st_ino
    new = random_bytes(n, seed=2)
    assert backend.write_async(path, filled(new), n, fsync=False, in_place=True).wait() == n
    assert path.read_bytes() == new.numpy().tobytes() + old[n:].numpy().tobytes()
    assert path.stat().st_ino == inode


def test_short_file_raises_naming_file(backend: IOBackend, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"a" * 100)
    with pytest.raises(OSError, match=r"short\.bin"):
        backend.read_async(path, aligned_empty(200), 200).wait()


def test_missing_file_raises(backend: IOBackend, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        backend.read_async(tmp_path / "nope.bin", aligned_empty(10), 10).wait()


def test_buffer_too_small_or_wrong_type(backend: IOBackend, tmp_path: Path) -> None:
    path = tmp_path / "b.bin"
    path.write_bytes(b"z" * 5000)
    small = torch.empty(5000, dtype=torch.uint8)  # 5000 < padded(5000) = 8192
    with pytest.raises(ValueError, match="8192"):
        backend.read_async(path, small, 5000)
    with pytest.raises(ValueError, match="aligned_empty"):
        backend.write_async(path, small, 5000)
    with pytest.raises(ValueError, match="uint8"):
        backend.read_async(path, torch.empty(4096, dtype=torch.float32), 10)


def test_many_futures_in_flight(backend: IOBackend, tmp_path: Path) -> None:
    datas = [random_bytes(1 << 20, seed=i) for i in range(8)]
    writes = [
        backend.write_async(tmp_path / f"{i}.bin", filled(d), d.numel())
        for i, d in enumerate(datas)
    ]
    assert [f.wait() for f in writes] == [1 << 20] * 8
    dsts = [aligned_empty(1 << 20) for _ in datas]
    reads = [backend.read_async(tmp_path / f"{i}.bin", d, 1 << 20) for i, d in enumerate(dsts)]
    for fut, dst, data in zip(reads, dsts, datas, strict=True):
        fut.wait()
        assert fut.done() and fut.seconds > 0
        assert torch.equal(dst[: data.numel()], data)


# -- POSIX specifics -----------------------------------------------------------------------


def test_posix_uses_direct_io_on_disk(posix_backend: IOBackend, tmp_path: Path) -> None:
    fut = posix_backend.write_async(tmp_path / "d.bin", filled(random_bytes(5000)), 5000)
    fut.wait()
    probe_ok = _direct_open_works(tmp_path)
    assert fut.direct is probe_ok
    assert (tmp_path / "d.bin").stat().st_size == 5000


def _direct_open_works(directory: Path) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / "probe")
    return True


def test_tmpfs_round_trip(posix_backend: IOBackend, tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    path = shm / f"bb-io-test-{os.getpid()}.bin"
    data = random_bytes(300_001, seed=3)
    try:
        w = posix_backend.write_async(path, filled(data), data.numel())
        w.wait()
        # tmpfs refuses O_DIRECT on older kernels and accepts it on newer ones
        assert w.direct is _direct_open_works(shm)
        dst = aligned_empty(data.numel())
        posix_backend.read_async(path, dst, data.numel()).wait()
        assert torch.equal(dst[: data.numel()], data)
    finally:
        path.unlink(missing_ok=True)


def test_direct_refused_falls_back_to_buffered(
    posix_backend: IOBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(sio.os, "open", refusing_open)
    data = random_bytes(70_000, seed=5)
    path = tmp_path / "f.bin"
    w = posix_backend.write_async(path, filled(data), data.numel())
    w.wait()
    assert w.direct is False
    assert path.read_bytes() == data.numpy().tobytes()
    dst = aligned_empty(data.numel())
    r = posix_backend.read_async(path, dst, data.numel())
    r.wait()
    assert r.direct is False and torch.equal(dst[: data.numel()], data)


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("op", ["pwritev", "preadv"])
def test_direct_transfer_refused_after_open_falls_back(
    posix_backend: IOBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A filesystem that opens O_DIRECT but fails the first direct transfer with EINVAL."""
    if not _direct_open_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open(); no direct transfer to fail")
    data = random_bytes(200_001, seed=6)  # several 64 KiB tasks and a short last block
    path = tmp_path / "f.bin"
    real = getattr(os, op)
    refused: list[int] = []

    def refuse_first_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if _is_direct(fd) and not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return int(real(fd, buffers, offset))

    if op == "preadv":  # write it buffered first, then fail the direct read
        path.write_bytes(data.numpy().tobytes())
    monkeypatch.setattr(sio.os, op, refuse_first_direct)
    if op == "pwritev":
        w = posix_backend.write_async(path, filled(data), data.numel())
        w.wait()
        assert w.direct is False
        assert path.read_bytes() == data.numpy().tobytes()
    else:
        dst = aligned_empty(data.numel())
        r = posix_backend.read_async(path, dst, data.numel())
        r.wait()
        assert r.direct is False and torch.equal(dst[: data.numel()], data)
    assert len(refused) == 1


def test_direct_read_never_asks_at_an_unaligned_offset(
    posix_backend: IOBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_open_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT; no direct reads to check")
    data = random_bytes(3 * ALIGNMENT + 123, seed=8)  # ends mid-block: a short last read
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    real = os.preadv
    direct_offsets: list[int] = []

    def watch(fd: int, buffers: list[memoryview], offset: int) -> int:
        if _is_direct(fd):
            direct_offsets.append(offset)
        return int(real(fd, buffers, offset))

    monkeypatch.setattr(sio.os, "preadv", watch)
    dst = aligned_empty(data.numel())
    r = posix_backend.read_async(path, dst, data.numel())
    r.wait()
    assert r.direct is True and torch.equal(dst[: data.numel()], data)
    assert direct_offsets and all(o % ALIGNMENT == 0 for o in direct_offsets), direct_offsets


def test_unaligned_buffer_uses_buffered_io(posix_backend: IOBackend, tmp_path: Path) -> None:
    data = random_bytes(10_000, seed=9)
    buf = aligned_empty(20_000)[1 : 1 + padded(10_000)]
    buf[:10_000] = data
    w = posix_backend.write_async(tmp_path / "u.bin", buf, 10_000)
    w.wait()
    assert w.direct is False
    assert (tmp_path / "u.bin").read_bytes() == data.numpy().tobytes()


def test_closed_backend_refuses(tmp_path: Path) -> None:
    b = open_backend(IOConfig(backend="posix"))
    b.close()
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.write_async(tmp_path / "x", aligned_empty(1), 1)
    kept = tmp_path / "kept.bin"
    kept.write_bytes(b"previous contents")
    with pytest.raises(RuntimeError, match="closed"):
        b.write_async(kept, aligned_empty(1), 1)
    assert kept.read_bytes() == b"previous contents"  # refused before open(O_TRUNC)
    with pytest.raises(RuntimeError, match="closed"):
        b.read_async(kept, aligned_empty(4), 4)


# -- helpers, config and backend choice -------------------------------------------------------


def test_padded_and_aligned_empty() -> None:
    assert [padded(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    for n in (0, 1, 4097, 1 << 20):
        buf = aligned_empty(n, pin=True)
        assert buf.dtype == torch.uint8 and buf.numel() == padded(n)
        assert buf.data_ptr() % ALIGNMENT == 0
        assert buf.is_pinned() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="-1"):
        padded(-1)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="task_size=1000"):
        IOConfig(task_size=1000)
    with pytest.raises(ValueError, match="threads=0"):
        IOConfig(threads=0)
    with pytest.raises(ValueError, match="'nvme'"):
        IOConfig(backend="nvme")  # type: ignore[arg-type]


def test_env_var_overrides_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    usable, reason = kvikio_status()
    monkeypatch.setenv(BACKEND_ENV, "posix")
    with open_backend(IOConfig()) as b:
        assert b.name == "posix"
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        open_backend()
    monkeypatch.setenv(BACKEND_ENV, "kvikio")
    with open_backend(IOConfig(backend="posix")) as b:
        assert b.name == "posix"  # explicit choice wins over the variable
    if usable:
        with open_backend() as b:
            assert b.name == "kvikio"
    else:
        with pytest.raises(ValueError, match="kvikio"):
            open_backend()
    monkeypatch.delenv(BACKEND_ENV)
    with open_backend() as b:
        assert b.name == ("kvikio" if usable else "posix"), reason


def test_future_chaining() -> None:
    seen: list[int] = []
    fut = IOFuture.completed(5).then(seen.append)
    assert fut.wait() == 5 and seen == [5]

    pending = IOFuture("p")
    chained = pending.then(seen.append)
    assert not chained.done()
    pending.set_exception(OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        chained.wait()
    assert seen == [5]

    def boom(_n: int) -> None:
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        IOFuture.completed(1).then(boom).wait()


@pytest.mark.gpu
@pytest.mark.kvikio
def test_kvikio_reads_into_cuda_tensor(tmp_path: Path) -> None:
    usable, reason = kvikio_status()
    if not usable or not torch.cuda.is_available():
        pytest.skip(f"needs kvikio and a CUDA device: {reason}")
    data = random_bytes(1 << 20, seed=11)
    path = tmp_path / "gpu.bin"
    path.write_bytes(data.numpy().tobytes())
    with open_backend(IOConfig(backend="kvikio")) as b:
        dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert b.read_async(path, dst, 1 << 20).wait() == 1 << 20
        assert torch.equal(dst.cpu(), data)
        b.write_async(tmp_path / "back.bin", dst, 1 << 20).wait()
    assert (tmp_path / "back.bin").read_bytes() == path.read_bytes()
