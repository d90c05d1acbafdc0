"""The NVMe tier: round trips, plain-zarr interop both ways, locking, bad input, corruption."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import storage.io as sio
from storage.io import IOBackend, aligned_empty
from storage.nvme import (
    DTYPES,
    CorruptTensorError,
    NvmeTier,
    StoreLockedError,
    UnsupportedArrayError,
)

GiB = 1 << 30
ToBuf = Callable[[torch.Tensor], torch.Tensor]
FromBuf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SHAPES = [(), (0,), (2, 0, 3), (7,), (3, 5, 2)]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def write(tier: NvmeTier, name: str, x: torch.Tensor, to_buffer: ToBuf) -> None:
    tier.create(name, x.shape, x.dtype)
    tier.write_async(name, to_buffer(x)).wait()


def read(tier: NvmeTier, name: str, from_buffer: FromBuf) -> torch.Tensor:
    spec = tier.spec(name)
    dst = aligned_empty(spec.nbytes)
    assert tier.read_async(name, dst).wait() == spec.nbytes
    return from_buffer(dst, torch.empty(spec.shape, dtype=spec.dtype))


def as_numpy(x: torch.Tensor) -> np.ndarray:
    """Reference numpy array as zarr should hold it (bf16 as its uint16 bits)."""
    if x.dtype is torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return np.frombuffer(
        x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
        dtype=np.dtype(DTYPES[x.dtype]).newbyteorder("<"),
    ).reshape(x.shape)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_round_trip_every_dtype_and_plain_zarr_reads_it(
    tmp_path: Path,
    posix_backend: IOBackend,
    to_buffer: ToBuf,
    from_buffer: FromBuf,
    dtype: torch.dtype,
) -> None:
    tensors = {f"model.layers.{i}.w": sample(s, dtype, i) for i, s in enumerate(SHAPES)}
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        for name, x in tensors.items():
            write(tier, name, x, to_buffer)
        assert tier.used == sum(x.numel() * x.element_size() for x in tensors.values())
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend, create=False) as tier:
        assert tier.names() == sorted(tensors)
        for name, x in tensors.items():
            assert tier.spec(name).shape == tuple(x.shape) and tier.spec(name).dtype == dtype
            assert torch.equal(read(tier, name, from_buffer), x)
    group = zarr.open_group(tmp_path / "s", mode="r")
    for name, x in tensors.items():
        arr = group[name]
        assert isinstance(arr, zarr.Array)
        assert arr.attrs["torch_dtype"] == str(dtype).removeprefix("torch.")
        assert arr.compressors == (zarr.codecs.Crc32cCodec(),) and arr.filters == ()
        assert arr.nchunks_initialized == (1 if x.numel() else 0)
        np.testing.assert_array_equal(arr[...], as_numpy(x))


def test_reads_group_written_by_plain_zarr(
    tmp_path: Path, posix_backend: IOBackend, from_buffer: FromBuf
) -> None:
    group = zarr.open_group(tmp_path / "z", mode="w")
    w = torch.randn(6, 4).bfloat16()
    b = np.arange(10, dtype=np.float32)
    a = group.create_array(
        "h.0.w", shape=(6, 4), dtype="uint16", chunks=(6, 4), compressors=None,
        fill_value=0, attributes={"torch_dtype": "bfloat16"},
    )  # fmt: skip
    a[...] = w.view(torch.int16).numpy().view(np.uint16)
    group.create_array("bias", shape=(10,), dtype="float32", chunks=(10,), compressors=None)[
        ...
    ] = b
    s = group.create_array("scalar", shape=(), dtype="int64", chunks=(), compressors=None)
    s[...] = np.int64(-42)
    with NvmeTier(tmp_path / "z", capacity=GiB, backend=posix_backend, create=False) as tier:
        assert tier.names() == ["bias", "h.0.w", "scalar"]
        assert torch.equal(read(tier, "h.0.w", from_buffer), w)
        assert torch.equal(read(tier, "bias", from_buffer), torch.from_numpy(b))
        assert read(tier, "scalar", from_buffer).item() == -42
        assert tier.chunk_path("scalar") == tmp_path / "z" / "scalar" / "c"


@pytest.mark.parametrize(
    "kwargs",
    [{"chunks": (2, 4)}, {"chunks": (4, 4), "compressors": "auto"}],
    ids=["several-chunks", "compressed"],
)
def test_refuses_chunked_or_compressed_arrays(
    tmp_path: Path, posix_backend: IOBackend, kwargs: dict[str, object]
) -> None:
    group = zarr.open_group(tmp_path / "z", mode="w")
    opts: dict[str, object] = {"compressors": None, **kwargs}
    group.create_array("odd.weight", shape=(4, 4), dtype="float32", **opts)[...] = 1.0  # type: ignore[arg-type]
    with pytest.raises(UnsupportedArrayError, match=r"odd\.weight"):
        NvmeTier(tmp_path / "z", capacity=GiB, backend=posix_backend)
    shutil.rmtree(tmp_path / "z" / "odd.weight")
    NvmeTier(tmp_path / "z", capacity=GiB, backend=posix_backend).close()  # lock was released


@pytest.mark.slow
def test_lock_in_process_and_across_processes(tmp_path: Path, posix_backend: IOBackend) -> None:
    path = tmp_path / "s"
    script = (
        "import sys\n"
        "from storage.io import open_backend\n"
        "from storage.nvme import NvmeTier, StoreLockedError\n"
        "for _ in sys.stdin:\n"
        "    try:\n"
        f"        NvmeTier({str(path)!r}, capacity=1, backend=open_backend()).close()\n"
        "        print('opened', flush=True)\n"
        "    except StoreLockedError as e:\n"
        "        print('locked:', e, flush=True)\n"
    )
    tier = NvmeTier(path, capacity=GiB, backend=posix_backend)
    with pytest.raises(StoreLockedError, match=rf"{path}.*process {os.getpid()}"):
        NvmeTier(path, capacity=GiB, backend=posix_backend)
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write("try\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line.startswith("locked:") and f"process {os.getpid()}" in line, line
        tier.close()
        tier.close()  # idempotent
        child.stdin.write("try\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "opened"
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    NvmeTier(path, capacity=GiB, backend=posix_backend).close()
    assert sorted(os.listdir(path)) == ["zarr.json"]  # no lock file left for plain zarr


def test_bad_paths_raise_before_writing(tmp_path: Path, posix_backend: IOBackend) -> None:
    with pytest.raises(ValueError, match=r"missing.*does not exist"):
        NvmeTier(tmp_path / "missing", capacity=1, backend=posix_backend, create=False)
    with pytest.raises(ValueError, match=r"no/such.*does not exist"):
        NvmeTier(tmp_path / "no" / "such", capacity=1, backend=posix_backend)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        NvmeTier(tmp_path / "file" / "s", capacity=1, backend=posix_backend)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_not_writable_directory(posix_backend: IOBackend) -> None:
    target = Path("/proc/self")
    if not target.is_dir() or os.access(target, os.W_OK):
        pytest.skip("needs a directory that even this user cannot write (/proc/self on Linux)")
    with pytest.raises(ValueError, match="not writable"):
        NvmeTier(target / "store", capacity=1, backend=posix_backend)


def test_capacity_beyond_free_disk(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf
) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"lower capacity") as refused:
        NvmeTier(tmp_path / "new", capacity=free + 100 * GiB, backend=posix_backend)
    said = re.search(r"\((\d+) bytes\) free", str(refused.value))
    assert said is not None, str(refused.value)
    # the free bytes when the tier checked (other processes write to the disk meanwhile)
    assert abs(int(said.group(1)) - free) < GiB
    assert not (tmp_path / "new").exists()
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        write(tier, "t", torch.arange(1000), to_buffer)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="free disk"):
        NvmeTier(tmp_path / "s", capacity=free + 100 * GiB, backend=posix_backend)
    with pytest.raises(ValueError, match="8000 bytes"):
        NvmeTier(tmp_path / "s", capacity=10, backend=posix_backend)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_capacity_names_and_delete(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf
) -> None:
    with NvmeTier(tmp_path / "s", capacity=1000, backend=posix_backend) as tier:
        write(tier, "a", torch.zeros(100, dtype=torch.int64), to_buffer)
        with pytest.raises(ValueError, match=r"'b' needs.*208 bytes"):
            tier.create("b", (26,), torch.int64)
        with pytest.raises(ValueError, match="already exists"):
            tier.create("a", (1,), torch.int64)
        for bad in ["", "a/b", "..", "__meta", "x.partial-1-2", ".bb-lock"]:
            with pytest.raises(ValueError, match="cannot be a zarr array"):
                tier.create(bad, (1,), torch.int8)
        with pytest.raises(ValueError, match="complex64"):
            tier.create("c", (1,), torch.complex64)
        tier.delete("a")
        assert tier.used == 0 and not tier.contains("a") and not (tmp_path / "s" / "a").exists()
        tier.create("b", (25,), torch.int64)
        with pytest.raises(KeyError, match="nope"):
            tier.spec("nope")
    assert zarr.open_array(tmp_path / "s" / "b", mode="r").shape == (25,)


def test_corruption_is_detected_naming_tensor_and_file(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf
) -> None:
    path = tmp_path / "s"
    with NvmeTier(path, capacity=GiB, backend=posix_backend) as tier:
        for name in ("trunc", "gone", "edited", "never"):
            write(tier, name, torch.arange(12, dtype=torch.float32).reshape(3, 4), to_buffer)
        tier.create("never.written", (5,), torch.float32)
        os.truncate(tier.chunk_path("trunc"), 20)
        os.unlink(tier.chunk_path("gone"))
    meta = json.loads((path / "edited" / "zarr.json").read_text())
    meta["shape"] = meta["chunk_grid"]["configuration"]["chunk_shape"] = [4, 4]
    (path / "edited" / "zarr.json").write_text(json.dumps(meta))
    with NvmeTier(path, capacity=GiB, backend=posix_backend) as tier:
        for name, why in [
            ("trunc", "holds 20 bytes"), ("gone", "incomplete"),
            ("edited", "holds 52 bytes.*64 bytes"), ("never.written", "incomplete"),
        ]:  # fmt: skip
            chunk = tier.chunk_path(name)
            with pytest.raises(CorruptTensorError, match=rf"'{name}'.*{chunk}.*") as err:
                tier.read_async(name, aligned_empty(64))
            assert err.match(why)
    meta["shape"] = [2, 4]  # shape no longer the chunk shape
    (path / "edited" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptTensorError, match=r"'edited'.*edited/zarr\.json.*disagrees"):
        NvmeTier(path, capacity=GiB, backend=posix_backend)


def test_stale_partial_files_are_removed(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf, from_buffer: FromBuf
) -> None:
    x = torch.arange(5000, dtype=torch.int32)
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        write(tier, "w", x, to_buffer)
        stale = tier.chunk_path("w").with_name("0.partial-999-0")
    stale.write_bytes(b"junk")
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        assert not stale.exists()
        assert torch.equal(read(tier, "w", from_buffer), x)


def test_bandwidth_benchmark_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_dir = Path(__file__).parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # as when run as a script: imports _common
    spec = importlib.util.spec_from_file_location("nvme_bandwidth", bench_dir / "nvme_bandwidth.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--dir", str(tmp_path), "--total-gib", str(8 / 1024), "--tensor-mib", "4"]
    result = bench.main([*args, "--repeats", "1"])
    assert result["write_ratio"] > 0 and result["read_ratio"] > 0
    out = capsys.readouterr().out
    assert "machine: CPU" in out and "ratio" in out and f"NVMe dir: {tmp_path} on " in out
    assert not list(tmp_path.rglob("*.bin"))


def test_failed_write_keeps_previous_version(
    tmp_path: Path,
    posix_backend: IOBackend,
    to_buffer: ToBuf,
    from_buffer: FromBuf,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = torch.arange(100_000, dtype=torch.int32)
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        write(tier, "w", old, to_buffer)

        def failing_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(sio.os, "pwritev", failing_pwritev)
        with pytest.raises(OSError, match="No space"):
            tier.write_async("w", to_buffer(-old)).wait()
        monkeypatch.undo()
        assert not list((tmp_path / "s").rglob("*.partial-*"))
        assert torch.equal(read(tier, "w", from_buffer), old)


def _inode(tier: NvmeTier, name: str) -> int:
    return tier.chunk_path(name).stat().st_ino


def test_a_scratch_array_is_rewritten_over_its_own_chunk(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf, from_buffer: FromBuf
) -> None:
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        tier.create("scratch", (50_001,), torch.float32, checksum=False, durable=False)
        tier.create("kept", (50_001,), torch.float32, checksum=False)
        inodes: dict[str, set[int]] = {"scratch": set(), "kept": set()}
        for step in range(3):
            x = sample((50_001,), torch.float32, seed=step)
            for name in inodes:
                tier.write_async(name, to_buffer(x)).wait()
                assert torch.equal(read(tier, name, from_buffer), x)
                inodes[name].add(_inode(tier, name))
                # plain zarr reads what was written last
                got = zarr.open_group(str(tmp_path / "s"), mode="r")[name][...]
                np.testing.assert_array_equal(got, x.numpy())
        assert len(inodes["scratch"]) == 1  # created once, then written in place
        assert len(inodes["kept"]) > 1  # each write a new file renamed onto the chunk
        assert not list((tmp_path / "s").rglob("*.partial-*"))


def test_a_scratch_array_with_checksums_is_still_replaced_atomically(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf, from_buffer: FromBuf
) -> None:
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        tier.create("c", (4096,), torch.int32, durable=False)
        seen = set()
        for step in range(3):
            x = sample((4096,), torch.int32, seed=step)
            tier.write_async("c", to_buffer(x)).wait()
            assert torch.equal(read(tier, "c", from_buffer), x)
            seen.add(_inode(tier, "c"))
        assert len(seen) > 1  # the trailer is written with the file: no write in place


def test_a_failed_write_over_a_scratch_chunk_is_refused_on_read_until_written_again(
    tmp_path: Path,
    posix_backend: IOBackend,
    to_buffer: ToBuf,
    from_buffer: FromBuf,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = torch.arange(100_000, dtype=torch.int32)
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        tier.create("w", old.shape, old.dtype, checksum=False, durable=False)
        tier.write_async("w", to_buffer(old)).wait()
        calls = [0]
        real = sio.os.pwritev

        def failing_second_piece(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(5, "Input/output error")
            return real(fd, buffers, offset)

        monkeypatch.setattr(sio.os, "pwritev", failing_second_piece)
        with pytest.raises(OSError, match="Input/output error"):
            tier.write_async("w", to_buffer(-old)).wait()
        monkeypatch.undo()
        # some pieces landed, others not: neither version is left to read
        with pytest.raises(CorruptTensorError, match=r"'w'.*failed part-way.*write it again"):
            tier.read_async("w", aligned_empty(old.numel() * 4)).wait()
        tier.write_async("w", to_buffer(-old)).wait()
        assert torch.equal(read(tier, "w", from_buffer), -old)
    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        assert torch.equal(read(tier, "w", from_buffer), -old)  # a later opener reads it


def test_a_scratch_array_written_in_pieces_goes_in_place_and_an_abort_tears_it(
    tmp_path: Path, posix_backend: IOBackend, to_buffer: ToBuf, from_buffer: FromBuf
) -> None:
    x = sample((100_000,), torch.float32)
    nbytes, step = x.numel() * 4, 64 << 10

    def pieces(t: torch.Tensor, count: int) -> list[tuple[int, torch.Tensor]]:
        raw = t.reshape(-1).view(torch.uint8)
        out = []
        for offset in range(0, nbytes, step)[:count]:
            n = min(step, nbytes - offset)
            buf = aligned_empty(n)
            buf[:n] = raw[offset : offset + n]
            out.append((offset, buf))
        return out

    with NvmeTier(tmp_path / "s", capacity=GiB, backend=posix_backend) as tier:
        tier.create("p", x.shape, x.dtype, checksum=False, durable=False)
        with tier.begin_write("p") as first:  # no chunk yet: a new file renamed onto it
            for offset, buf in pieces(x, 99):
                first.write_async(buf, offset=offset, nbytes=min(step, nbytes - offset)).wait()
            first.commit()
        inode = _inode(tier, "p")
        with tier.begin_write("p") as again:
            for offset, buf in pieces(-x, 99):
                again.write_async(buf, offset=offset, nbytes=min(step, nbytes - offset)).wait()
            again.commit()
        assert torch.equal(read(tier, "p", from_buffer), -x) and _inode(tier, "p") == inode
        assert not list((tmp_path / "s").rglob("*.partial-*"))
        with tier.begin_write("p") as torn:  # left after one piece, without commit()
            offset, buf = pieces(x, 1)[0]
            torn.write_async(buf, offset=offset, nbytes=step).wait()
        with pytest.raises(CorruptTensorError, match="failed part-way"):
            tier.read_async("p", aligned_empty(nbytes)).wait()
