"""A tensor registered over file pieces the store does not own: paged in and read from
those files in place, checked against their CRC-32C trailers, never written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from storage.checksum import crc32c, encode
from storage.chunk_io import ChecksumError
from storage.external import ExternalSource, FilePiece, ReadOnlyTensorError
from storage.io import IOConfig
from storage.store import StoreConfig, TieredStore
from storage.tiers import Link, Tier

MiB = 1 << 20
SHAPES = [(5, 37), (61, 90), (3,), (129, 33)]  # unaligned byte counts, one over 4 KiB twice


def _config(tmp_path: Path, **overrides: object) -> StoreConfig:
    base: dict[str, object] = {
        "device_budget": 8 * MiB,
        "host_budget": 8 * MiB,
        "nvme_path": str(tmp_path / "nvme"),
        "nvme_budget": 8 * MiB,
        "staging_buffers": 2,
        "staging_bytes": 4096,
        "io": IOConfig(backend="posix", threads=2, task_size=64 << 10),
        "device": "cpu",
    }
    base.update(overrides)
    return StoreConfig(**base)  # type: ignore[arg-type]


def _files(tmp_path: Path, checksum: bool = True) -> tuple[list[FilePiece], torch.Tensor]:
    """bf16 tensors written as chunk files (raw bytes, then their CRC-32C), and the flat
    bf16 concatenation a reader must produce."""
    g = torch.Generator().manual_seed(3)
    parts, pieces = [], []
    for i, shape in enumerate(SHAPES):
        t = torch.randn(shape, generator=g).to(torch.bfloat16)
        raw = t.reshape(-1).view(torch.uint8)
        path = tmp_path / "src" / f"t{i}" / "c" / "0"
        path.parent.mkdir(parents=True)
        path.write_bytes(raw.numpy().tobytes() + (encode(crc32c(raw)) if checksum else b""))
        parts.append(t.reshape(-1))
        pieces.append(FilePiece(path=path, nbytes=raw.numel(), checksum=checksum))
    return pieces, torch.cat(parts)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("nvme", [True, False], ids=["with-nvme-tier", "no-nvme-tier"])
def test_pages_in_and_reads_the_files_in_place(tmp_path: Path, stage: bool, nvme: bool) -> None:
    pieces, want = _files(tmp_path)
    before = _digests(tmp_path / "src")
    config = _config(tmp_path, stage_nvme=stage)
    if not nvme:
        config = _config(tmp_path, nvme_path=None, nvme_budget=0)
    with TieredStore(config) as store:
        store.register("w", shape=(want.numel(),), dtype=torch.bfloat16, home=Tier.NVME,
                       source=pieces)  # fmt: skip
        assert store.home("w") is Tier.NVME
        assert torch.equal(store.prefetch_async("w").wait()["w"], want)
        store.release("w")
        assert torch.equal(store.read("w"), want)
        out = torch.empty(want.numel() + 1, dtype=torch.bfloat16)[1:]  # an unaligned buffer
        assert torch.equal(store.read("w", out), want)
        stats = store.stats()
        assert stats[Link.HOST_TO_NVME].bytes == 0
        assert stats[Link.NVME_TO_DEVICE].bytes == want.numel() * 2
        assert store.usage()[Tier.NVME][0] == 0  # no NVMe budget taken
    assert _digests(tmp_path / "src") == before
    scratch = tmp_path / "nvme"
    assert not scratch.exists() or not [p for p in scratch.rglob("*") if "/c/" in str(p)]


def test_a_write_or_move_is_refused_and_the_files_stay(tmp_path: Path) -> None:
    pieces, want = _files(tmp_path)
    before = _digests(tmp_path / "src")
    with TieredStore(_config(tmp_path)) as store:
        store.register("w", shape=(want.numel(),), dtype=torch.bfloat16, home=Tier.NVME,
                       source=pieces)  # fmt: skip
        with pytest.raises(ReadOnlyTensorError, match=r"'w' is read-only.*cannot write"):
            store.write("w", torch.zeros_like(want))
        with pytest.raises(ReadOnlyTensorError, match="cannot move to host"):
            store.move("w", Tier.HOST)
        store.prefetch_async("w").wait()
        with pytest.raises(ReadOnlyTensorError, match="cannot write back"):
            store.write_back_async("w")
        store.release("w")
        assert torch.equal(store.read("w"), want)
    assert _digests(tmp_path / "src") == before


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_a_damaged_file_fails_its_checksum_naming_it(tmp_path: Path, stage: bool) -> None:
    pieces, want = _files(tmp_path)
    damaged = pieces[1].path
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x01
    damaged.write_bytes(bytes(data))
    with TieredStore(_config(tmp_path, stage_nvme=stage)) as store:
        store.register("w", shape=(want.numel(),), dtype=torch.bfloat16, home=Tier.NVME,
                       source=pieces)  # fmt: skip
        with pytest.raises(ChecksumError, match=f"file {damaged} fails its CRC-32C"):
            store.read("w")


def test_pieces_of_the_wrong_size_are_refused_at_register(tmp_path: Path) -> None:
    pieces, want = _files(tmp_path)
    with TieredStore(_config(tmp_path)) as store:
        with pytest.raises(ValueError, match=r"hold .* bytes but the tensor needs"):
            store.register("a", shape=(want.numel() + 1,), dtype=torch.bfloat16,
                           home=Tier.NVME, source=pieces)  # fmt: skip
        short = pieces[0].path
        short.write_bytes(short.read_bytes()[:-5])
        with pytest.raises(ValueError, match=f"file {short} holds .* bytes, not the"):
            store.register("b", shape=(want.numel(),), dtype=torch.bfloat16,
                           home=Tier.NVME, source=pieces)  # fmt: skip
        assert store.names() == []


def test_reads_in_parts_are_whole_and_checked(tmp_path: Path) -> None:
    pieces, want = _files(tmp_path)
    raw = want.view(torch.uint8)
    source = ExternalSource("w", pieces, raw.numel())
    out = torch.empty_like(raw)
    for at in range(0, raw.numel(), 4096):
        n = min(4096, raw.numel() - at)
        source.read_into(out[at : at + n], at, n)
    assert torch.equal(out, raw)
    damaged = pieces[3].path  # 8514 bytes: read in three parts
    data = bytearray(damaged.read_bytes())
    data[5000] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"file {damaged} fails"):
        for at in range(0, raw.numel(), 4096):
            n = min(4096, raw.numel() - at)
            source.read_into(out[at : at + n], at, n)
