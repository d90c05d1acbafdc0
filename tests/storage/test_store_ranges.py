"""TieredStore element ranges: a piece of a flat tensor read or written without the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.io import IOConfig, aligned_empty
from storage.store import StoreConfig, TieredStore
from storage.tiers import Link, Tier

MiB = 1 << 20
NUMEL = 10_000
PIECE = 2048  # fp32 elements: 8 KiB, two 4 KiB blocks; the last piece is 1,808 elements


def _config(path: Path) -> StoreConfig:
    return StoreConfig(
        device_budget=4 * MiB,
        host_budget=4 * MiB,
        nvme_path=str(path / "nvme"),
        nvme_budget=16 * MiB,
        staging_buffers=2,
        staging_bytes=MiB,
        io=IOConfig(backend="posix", threads=2, task_size=4096),
        device="cpu",
    )


def _buffer() -> torch.Tensor:
    """A 4 KiB-aligned fp32 host buffer of one piece."""
    return aligned_empty(PIECE * 4).view(torch.float32)[:PIECE]


@pytest.mark.parametrize("home", [Tier.DEVICE, Tier.HOST, Tier.NVME], ids=lambda t: t.value)
def test_ranges_read_and_write_pieces_in_place(tmp_path: Path, home: Tier) -> None:
    """Every piece read equals that slice of the tensor; pieces written (the uneven last
    one included) change only their elements; NVMe counts exactly their bytes."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    expect = x.clone()
    with TieredStore(_config(tmp_path)) as store:
        store.register("state", x, home=home, scratch=True)
        buf = _buffer()
        before = store.stats()[Link.HOST_TO_NVME].bytes
        written = 0
        for start in range(0, NUMEL, PIECE):
            count = min(PIECE, NUMEL - start)
            got = store.read_range_async("state", buf, start, count).wait_host()["state"]
            torch.testing.assert_close(got, x[start : start + count], rtol=0, atol=0)
            if start // PIECE in (1, 4):  # a middle piece and the uneven last one
                buf[:count].mul_(-2.0).add_(1.0)
                expect[start : start + count] = buf[:count]
                store.write_range_async("state", buf, start, count).wait_host()
                written += count * 4
        torch.testing.assert_close(store.read("state"), expect, rtol=0, atol=0)
        if home is Tier.NVME:
            assert store.stats()[Link.HOST_TO_NVME].bytes - before == written


def test_unwritten_nvme_tensor_reads_zeros_and_takes_a_piece(tmp_path: Path) -> None:
    """A never-written NVMe tensor reads as zeros by range; a piece written makes its chunk,
    the rest zeros."""
    with TieredStore(_config(tmp_path)) as store:
        store.register("grad", shape=(NUMEL,), dtype=torch.float32, home=Tier.NVME, scratch=True)
        buf = _buffer().fill_(7.0)
        assert not store.read_range_async("grad", buf, PIECE, PIECE).wait_host()["grad"].any()
        buf.fill_(3.0)
        store.write_range_async("grad", buf, PIECE, PIECE).wait_host()
        expect = torch.zeros(NUMEL)
        expect[PIECE : 2 * PIECE] = 3.0
        torch.testing.assert_close(store.read("grad"), expect, rtol=0, atol=0)


def test_ranges_refuse_checksummed_arrays_and_bad_ranges(tmp_path: Path) -> None:
    """A durable (checksummed) NVMe tensor is written whole only; a range past the end or
    a buffer too small fails before anything moves, naming the tensor."""
    x = torch.arange(NUMEL, dtype=torch.float32)
    with TieredStore(_config(tmp_path)) as store:
        store.register("weights", x, home=Tier.NVME)
        store.register("host", x, home=Tier.HOST, scratch=True)
        buf = _buffer()
        with pytest.raises(ValueError, match=r"'weights'.*write it whole"):
            store.write_range_async("weights", buf, 0, PIECE)
        with pytest.raises(ValueError, match=r"'host'.*elements \[9000, 11048\)"):
            store.read_range_async("host", buf, 9000, PIECE)
        with pytest.raises(ValueError, match=r"'host'.*buffer of 2048"):
            store.read_range_async("host", buf, 0, PIECE + 1)
        torch.testing.assert_close(store.read("weights"), x, rtol=0, atol=0)
