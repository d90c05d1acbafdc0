"""Transfers in pieces: backend file offsets, partial NVMe reads and writes, staged store paths."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from storage.io import ALIGNMENT, IOBackend, IOConfig, aligned_empty, open_backend
from storage.nvme import NvmeError, NvmeTier
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

PIECE = 2 * ALIGNMENT  # bytes of one staging buffer in the staged store tests
# sizes around the piece boundaries: empty, one byte, exact pieces, a byte over, several
SIZES = [0, 1, ALIGNMENT - 1, PIECE, PIECE + 1, 3 * PIECE + 5, 40_000]


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def buffer_of(data: np.ndarray) -> torch.Tensor:
    buf = aligned_empty(len(data))
    buf[: len(data)] = torch.from_numpy(data)
    return buf


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def backend(request: pytest.FixtureRequest) -> Iterator[IOBackend]:
    config = IOConfig(backend="posix", threads=2, task_size=ALIGNMENT, direct=request.param)
    with open_backend(config) as b:
        yield b


# -- backend ---------------------------------------------------------------------------------


def test_backend_writes_and_reads_pieces_at_offsets(backend: IOBackend, tmp_path: Path) -> None:
    data = random_bytes(3 * PIECE + 123)
    path = tmp_path / "f"
    for offset in range(0, len(data), PIECE):
        piece = data[offset : offset + PIECE]
        backend.write_async(path, buffer_of(piece), len(piece), offset=offset, fsync=False).wait()
    assert path.read_bytes() == data.tobytes()  # plain file read is the reference
    for offset in (0, ALIGNMENT, 3 * PIECE):
        n = min(PIECE + 7, len(data) - offset)
        dst = aligned_empty(n)
        assert backend.read_async(path, dst, n, offset=offset).wait() == n
        assert np.array_equal(dst[:n].numpy(), data[offset : offset + n])


def test_backend_offset_zero_still_truncates(backend: IOBackend, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 3 * ALIGNMENT)
    data = random_bytes(100)
    backend.write_async(path, buffer_of(data), 100).wait()
    assert path.read_bytes() == data.tobytes()


def test_backend_rejects_bad_offsets(backend: IOBackend, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(2 * ALIGNMENT))
    buf = aligned_empty(ALIGNMENT)
    with pytest.raises(ValueError, match=r"offset 100 bytes.*multiple of 4096"):
        backend.read_async(path, buf, 10, offset=100)
    with pytest.raises(ValueError, match=r"offset -4096 bytes"):
        backend.write_async(path, buf, 10, offset=-ALIGNMENT)
    with pytest.raises(OSError, match=r"holds 8192 bytes but 8193"):
        backend.read_async(path, buf, 1, offset=2 * ALIGNMENT)


# -- NVMe tier -------------------------------------------------------------------------------


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[NvmeTier]:
    with (
        open_backend(IOConfig(backend="posix", threads=2, task_size=ALIGNMENT)) as b,
        NvmeTier(tmp_path / "nvme", capacity=1 << 20, backend=b) as t,
    ):
        yield t


def write_whole(tier: NvmeTier, name: str, data: np.ndarray) -> None:
    tier.write_async(name, buffer_of(data)).wait()


def test_nvme_partial_read_and_piecewise_write(tier: NvmeTier) -> None:
    data = random_bytes(5 * ALIGNMENT + 11)
    tier.create("w", (len(data),), torch.uint8)
    with tier.begin_write("w") as handle:
        for offset in range(0, len(data), PIECE):
            piece = data[offset : offset + PIECE]
            handle.write_async(buffer_of(piece), offset=offset, nbytes=len(piece)).wait()
        handle.commit()
    assert np.array_equal(zarr.open_array(str(tier.path / "w"), mode="r")[...], data)
    dst = aligned_empty(PIECE)
    assert tier.read_async("w", dst, offset=2 * ALIGNMENT, nbytes=PIECE).wait() == PIECE
    assert np.array_equal(dst.numpy(), data[2 * ALIGNMENT : 2 * ALIGNMENT + PIECE])
    tail = len(data) - 4 * ALIGNMENT
    tier.read_async("w", dst, offset=4 * ALIGNMENT).wait()  # nbytes defaults to the rest
    assert np.array_equal(dst[:tail].numpy(), data[4 * ALIGNMENT :])
    assert not list(tier.path.rglob("*.partial-*"))


def test_nvme_piece_bounds_are_checked(tier: NvmeTier) -> None:
    tier.create("w", (3 * ALIGNMENT,), torch.uint8)
    write_whole(tier, "w", random_bytes(3 * ALIGNMENT))
    buf = aligned_empty(PIECE)
    with pytest.raises(ValueError, match=r"'w'.*offset 10 bytes"):
        tier.read_async("w", buf, offset=10)
    with pytest.raises(ValueError, match=r"'w'.*8192 bytes from offset 8192.*nbytes <= 4096"):
        tier.read_async("w", buf, offset=PIECE, nbytes=PIECE)
    handle = tier.begin_write("w")
    with pytest.raises(ValueError, match=r"offset 4096 bytes does not follow the 0 bytes"):
        handle.write_async(buf, offset=ALIGNMENT, nbytes=ALIGNMENT)
    handle.abort()
    with pytest.raises(NvmeError, match="committed or aborted"):
        handle.write_async(buf, nbytes=ALIGNMENT)


@pytest.mark.parametrize("ending", ["abort", "short", "crash"])
def test_unfinished_piecewise_write_keeps_the_old_version(
    tier: NvmeTier, tmp_path: Path, ending: str
) -> None:
    old, new = random_bytes(3 * ALIGNMENT, seed=1), random_bytes(3 * ALIGNMENT, seed=2)
    tier.create("w", (len(old),), torch.uint8)
    write_whole(tier, "w", old)
    handle = tier.begin_write("w")
    handle.write_async(buffer_of(new[:PIECE]), nbytes=PIECE).wait()
    if ending == "abort":
        handle.abort()
        assert not list(tier.path.rglob("*.partial-*"))
    elif ending == "short":
        with pytest.raises(NvmeError, match=r"8192 of 12288 bytes were written"):
            handle.commit()
    else:  # the process dies here: the partial file stays until the next opener
        assert len(list(tier.path.rglob("*.partial-*"))) == 1
    dst = aligned_empty(len(old))
    tier.read_async("w", dst).wait()
    assert np.array_equal(dst.numpy(), old)
    if ending == "crash":
        tier.close()
        with (
            open_backend(IOConfig(backend="posix")) as b,
            NvmeTier(tier.path, capacity=1 << 20, backend=b) as again,
        ):
            assert not list(again.path.rglob("*.partial-*"))
            again.read_async("w", dst).wait()
            assert np.array_equal(dst.numpy(), old)


# -- staged store ----------------------------------------------------------------------------


def staged_store(path: Path, **overrides: object) -> TieredStore:
    config: dict[str, object] = {
        "device_budget": 1 << 20,
        "host_budget": 1 << 20,
        "nvme_path": str(path / "nvme"),
        "nvme_budget": 1 << 20,
        "staging_buffers": 1,
        "staging_bytes": PIECE,
        "stage_nvme": True,
        "io": IOConfig(backend="posix", threads=2, task_size=ALIGNMENT),
        "device": "cpu",
        "copy_threads": 2,
    }
    config.update(overrides)
    return TieredStore(StoreConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize("nbytes", SIZES)
def test_staged_round_trips_equal(tmp_path: Path, nbytes: int) -> None:
    x = torch.from_numpy(random_bytes(nbytes, seed=nbytes)).view(torch.int8)
    with staged_store(tmp_path) as store:
        store.register("w", x, home=Tier.NVME)  # staged write
        assert torch.equal(store.read("w"), x)
        out = torch.empty_like(x)
        assert store.read("w", out=out) is out and torch.equal(out, x)  # staged read into out
        dev = store.prefetch_async("w").wait()["w"]  # staged page-in
        assert torch.equal(dev, x)
        dev.neg_()
        store.write_back_async("w").wait()  # staged write-back from the device slot
        store.release("w")
        stored = np.asarray(zarr.open_array(str(tmp_path / "nvme" / "w"), mode="r")[...])
        assert np.array_equal(stored, (-x).numpy())
        store.move("w", Tier.HOST)
        store.move("w", Tier.NVME)
        assert torch.equal(store.read("w"), -x)


def test_staged_transfers_count_pieces(tmp_path: Path) -> None:
    nbytes = 3 * PIECE + 5
    x = torch.from_numpy(random_bytes(nbytes)).view(torch.int8)
    with staged_store(tmp_path) as store:
        store.register("w", x, home=Tier.NVME)
        before = store.stats()
        store.prefetch_async("w").wait()
        store.write_back_async("w").wait()
        after = store.stats()
    moved = {k: (after[k].bytes - before[k].bytes, after[k].count - before[k].count) for k in after}
    assert moved["nvme_read"] == (nbytes, 4)  # four pieces through the staging buffer
    assert moved["h2d"] == (nbytes, 4)
    assert moved["d2h"] == (nbytes, 4)
    assert moved["nvme_write"] == (nbytes, 4)
    assert moved["nvme_read_direct"] == moved["nvme_write_direct"] == (0, 0)


def test_staged_concurrent_page_ins_share_one_buffer(tmp_path: Path) -> None:
    xs = {f"t{i}": torch.from_numpy(random_bytes(5 * PIECE + i, seed=i)) for i in range(6)}
    with staged_store(tmp_path, copy_threads=3) as store:
        for name, x in xs.items():
            store.register(name, x, home=Tier.NVME)
        got = store.prefetch_async(list(xs)).wait()
        assert all(torch.equal(got[n], x) for n, x in xs.items())
        for name in xs:
            store.write_back_async(name, xs[name].flip(0))
        store.release(list(xs))
        assert all(torch.equal(store.read(n), x.flip(0)) for n, x in xs.items())


def test_caller_tensor_larger_than_staging_streams_through_it(tmp_path: Path) -> None:
    """Without forced staging, a caller's tensor of 10 pieces is written in 10 staged pieces,
    and read back into an unaligned tensor through them (an aligned one is read directly:
    where ``empty_like`` lands depends on the allocator, so the test picks the address)."""
    x = torch.arange(10 * PIECE // 4, dtype=torch.float32)
    with staged_store(tmp_path, stage_nvme=False) as store:
        store.register("w", x, home=Tier.NVME)
        assert store.stats()["nvme_write"].count == 10
        out = torch.empty(x.numel() + 1, dtype=x.dtype)[1:]  # 4 bytes past an allocation
        assert out.data_ptr() % 4096 != 0
        assert torch.equal(store.read("w", out=out), x)
        assert store.stats()["nvme_read"].count == 10
        assert (
            os.path.getsize(tmp_path / "nvme" / "w" / "c" / "0") == x.numel() * 4 + 4
        )  # + CRC-32C
