"""Chunk checksums (zarr's crc32c codec) and disk faults of the NVMe tier and the store."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import zarr

from storage import ALIGNMENT, IOConfig, StoreConfig, Tier, TieredStore, aligned_empty, nvme
from storage.fault_injection import Fault, inject
from storage.io import IOBackend
from storage.nvme import ChecksumError, NvmeIOError, NvmeTier

# a whole number of 4 KiB blocks (trailer read apart), a few bytes short of one (trailer
# past the padding), and odd sizes (trailer in the buffer's padding)
SIZES = [4 * ALIGNMENT, ALIGNMENT - 2, 3 * ALIGNMENT + 100, 7]


def buffer_of(x: torch.Tensor) -> torch.Tensor:
    raw = x.contiguous().view(-1).view(torch.uint8)
    buf = aligned_empty(raw.numel())
    buf[: raw.numel()] = raw
    return buf


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def tier(tmp_path: Path, posix_backend: IOBackend) -> Iterator[NvmeTier]:
    with NvmeTier(tmp_path / "s", capacity=1 << 30, backend=posix_backend) as t:
        yield t


@pytest.fixture(params=["one-read", "pipelined"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Whole reads in one backend read, or in 4 KiB pieces checksummed as they arrive."""
    if request.param == "pipelined":
        monkeypatch.setattr(nvme, "VERIFY_PIECE_BYTES", ALIGNMENT)
    return str(request.param)


@pytest.mark.parametrize("nbytes", SIZES)
def test_chunk_ends_with_the_crc32c_plain_zarr_checks(
    tier: NvmeTier, nbytes: int, pieces: str
) -> None:
    x = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8))
    tier.create("w", (nbytes,), torch.uint8)
    tier.write_async("w", buffer_of(x)).wait()
    raw = tier.chunk_path("w").read_bytes()
    assert raw[:nbytes] == x.numpy().tobytes()
    assert raw[nbytes:] == np.uint32(google_crc32c.value(x.numpy().tobytes())).tobytes()
    dst = aligned_empty(nbytes)
    assert tier.read_async("w", dst).wait() == nbytes
    assert torch.equal(dst[:nbytes], x)
    np.testing.assert_array_equal(zarr.open_group(tier.path, mode="r")["w"][...], x.numpy())

    for at in (nbytes // 2, nbytes + 1):  # a data byte, then a checksum byte
        flip(tier.chunk_path("w"), at)
        with pytest.raises(ChecksumError, match=rf"tensor 'w'.*{tier.chunk_path('w')}.*CRC-32C"):
            tier.read_async("w", aligned_empty(nbytes)).wait()
        with pytest.raises(ValueError, match="checksum"):
            zarr.open_group(tier.path, mode="r")["w"][...]
        flip(tier.chunk_path("w"), at)


def test_pieces_are_verified_in_order_and_out_of_order(tier: NvmeTier) -> None:
    x = torch.arange(5 * ALIGNMENT // 4 + 3, dtype=torch.int32)
    nbytes = x.numel() * 4
    tier.create("w", tuple(x.shape), torch.int32)
    tier.write_async("w", buffer_of(x)).wait()
    starts = list(range(0, nbytes, 2 * ALIGNMENT))

    def read_pieces(order: list[int]) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        for at in order:
            n = min(2 * ALIGNMENT, nbytes - at)
            buf = aligned_empty(n)
            tier.read_async("w", buf, offset=at, nbytes=n).wait()
            out[at : at + n] = buf[:n]
        return out.view(torch.int32)

    assert torch.equal(read_pieces(starts), x)
    assert torch.equal(read_pieces(starts[::-1]), x)
    flip(tier.chunk_path("w"), 3)  # in the first piece: found when the last piece arrives
    for order in (starts, starts[::-1]):
        with pytest.raises(ChecksumError, match="tensor 'w'"):
            read_pieces(order)


def test_staged_store_refuses_a_damaged_chunk(tmp_path: Path) -> None:
    x = torch.randn(3 * ALIGNMENT // 4 + 5)
    config = StoreConfig(
        device_budget=1 << 20, host_budget=1 << 20, nvme_path=str(tmp_path / "nvme"),
        nvme_budget=1 << 20, staging_buffers=1, staging_bytes=ALIGNMENT, stage_nvme=True,
        io=IOConfig(backend="posix", threads=2, task_size=ALIGNMENT), device="cpu",
    )  # fmt: skip
    with TieredStore(config) as store:
        store.register("w", x, home=Tier.NVME)
        assert torch.equal(store.read("w"), x)
        flip(tmp_path / "nvme" / "w" / "c" / "0", 2 * ALIGNMENT + 1)
        with pytest.raises(ChecksumError, match=r"tensor 'w'.*nvme/w/c/0"):
            store.prefetch_async("w").wait()


def test_format_1_arrays_open_read_and_keep_their_layout(
    tmp_path: Path, posix_backend: IOBackend
) -> None:
    """Arrays without a checksum (plain zarr's default, and this tier before format 2)."""
    group = zarr.open_group(tmp_path / "old", mode="w")
    a = np.arange(1000, dtype=np.float32)
    group.create_array("a", shape=a.shape, dtype="float32", chunks=a.shape, compressors=None)[
        ...
    ] = a
    with NvmeTier(tmp_path / "old", capacity=1 << 30, backend=posix_backend) as tier:
        spec = tier.spec("a")
        assert not spec.checksum and spec.format_version == 1
        dst = aligned_empty(a.nbytes)
        tier.read_async("a", dst).wait()
        np.testing.assert_array_equal(dst[: a.nbytes].view(torch.float32).numpy(), a)
        tier.write_async("a", buffer_of(torch.from_numpy(-a))).wait()
        assert tier.chunk_path("a").stat().st_size == a.nbytes  # still format 1
        tier.create("b", (3,), torch.float32)
        assert tier.spec("b").checksum
    np.testing.assert_array_equal(zarr.open_group(tmp_path / "old", mode="r")["a"][...], -a)
    codecs = json.loads((tmp_path / "old" / "b" / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "crc32c"]


def _store(path: Path) -> TieredStore:
    config = StoreConfig(
        device_budget=1 << 20, host_budget=1 << 20, nvme_path=str(path), nvme_budget=1 << 20,
        io=IOConfig(backend="posix", threads=2), device="cpu",
    )  # fmt: skip
    return TieredStore(config)


def test_eio_on_page_in_names_tensor_and_file_never_a_zero_page(
    tmp_path: Path, pieces: str
) -> None:
    xs = {f"w{i}": torch.randn(3000) + 5 for i in range(3)}
    with inject() as faults, _store(tmp_path / "nvme") as store:
        for name, x in xs.items():
            store.register(name, x, home=Tier.NVME)
        faults.append(Fault("read", errno.EIO, path_contains=f"{os.sep}w1{os.sep}", times=1))
        ticket = store.prefetch_async(list(xs))
        with pytest.raises(
            NvmeIOError, match=r"tensor 'w1': cannot read .*/w1/c/0.*I/O error"
        ) as err:
            ticket.wait()
        assert err.value.errno == errno.EIO and len(faults[0].failed) == 1
        store.release([n for n in xs if store.state(n).name == "RESIDENT"])
        again = store.prefetch_async(list(xs))  # the fault is gone: every tensor pages in whole
        again.wait()
        assert all(torch.equal(store.get(name), x) for name, x in xs.items())


def test_full_disk_on_write_back_keeps_previous_contents(tmp_path: Path) -> None:
    x = torch.randn(1000)
    with inject() as faults, _store(tmp_path / "nvme") as store:
        store.register("w", x, home=Tier.NVME)
        faults.append(Fault("write", errno.ENOSPC, times=1))
        with pytest.raises(NvmeIOError, match=r"tensor 'w': cannot write .*disk is full") as err:
            store.write("w", -x)
        assert err.value.errno == errno.ENOSPC
        assert not list((tmp_path / "nvme").rglob("*.partial-*"))
        assert torch.equal(store.read("w"), x)
        store.write("w", 2 * x)  # the store is still usable
        assert torch.equal(store.read("w"), 2 * x)


def test_checksum_benchmark_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_dir = Path(__file__).parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # as when run as a script: imports _common
    spec = importlib.util.spec_from_file_location("checksum_cost", bench_dir / "checksum_cost.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--dir", str(tmp_path), "--count", "2", "--tensor-mib", "1"])
    assert all(math.isfinite(v) and v > 0 for k, v in result.items() if k != "added")
    out = capsys.readouterr().out
    assert "machine: CPU" in out and "ratio verified / unverified" in out
    assert not (tmp_path / "checksum-cost").exists()  # scratch stores removed


@pytest.mark.parametrize("verified", [False, True])
def test_scratch_tensors_have_no_trailer_unless_asked_and_stay_plain_zarr(
    tmp_path: Path, verified: bool
) -> None:
    """A scratch tensor (rewritten often, read back by this process only) is written
    without the CRC-32C trailer; ``scratch_checksums`` keeps it; other tensors keep theirs,
    and a scratch tensor moved onto NVMe later is laid out the same way."""
    x, y = torch.randn(3000), torch.randn(777)
    config = StoreConfig(
        device_budget=1 << 20, host_budget=1 << 20, nvme_path=str(tmp_path / "n"),
        nvme_budget=1 << 20, io=IOConfig(backend="posix", threads=2), device="cpu",
        scratch_checksums=verified,
    )  # fmt: skip
    with TieredStore(config) as store:
        store.register("state", x, home=Tier.NVME, scratch=True)
        store.register("weights", x, home=Tier.NVME)
        store.register("later", y, home=Tier.HOST, scratch=True)
        store.move("later", Tier.NVME)
        store.write("state", -x)
        assert torch.equal(store.read("state"), -x)
        assert torch.equal(store.read("later"), y)
    group = zarr.open_group(tmp_path / "n", mode="r")
    np.testing.assert_array_equal(group["state"][...], -x.numpy())  # plain zarr reads it
    np.testing.assert_array_equal(group["later"][...], y.numpy())
    for name, n, scratch in (("state", x.numel(), True), ("later", y.numel(), True),
                             ("weights", x.numel(), False)):  # fmt: skip
        codecs = json.loads((tmp_path / "n" / name / "zarr.json").read_text())["codecs"]
        trailer = verified or not scratch
        assert [c["name"] for c in codecs] == ["bytes", "crc32c"][: 2 if trailer else 1]
        size = (tmp_path / "n" / name / "c" / "0").stat().st_size
        assert size == 4 * n + (4 if trailer else 0)
    flip(tmp_path / "n" / "state" / "c" / "0", 10)
    with TieredStore(config) as store:  # the arrays are adopted with their layout
        store.register("state", home=Tier.NVME, scratch=True)
        if verified:
            with pytest.raises(ChecksumError, match="tensor 'state'"):
                store.read("state")
        else:
            assert not torch.equal(store.read("state"), -x)  # unverified: read as stored
