"""A run's scratch directory: claimed, rebuilt at each open, and told apart from a user's data."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from storage import scratch
from storage.io import IOBackend, aligned_empty
from storage.nvme import NvmeTier, StoreLockedError
from storage.scratch import MARKER_NAME, SCRATCH_ATTR, prepare_dir, read_marker

MIB = 1 << 20


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> SHA-256 of its bytes), and every folder."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def fill(tier: NvmeTier, name: str, value: torch.Tensor) -> None:
    tier.create(name, value.shape, value.dtype)
    buf = aligned_empty(value.numel() * value.element_size())
    buf[: value.numel() * value.element_size()].copy_(value.reshape(-1).view(torch.uint8))
    tier.write_async(name, buf).wait()


def test_a_scratch_directory_is_rebuilt_for_a_run_of_another_dtype(
    tmp_path: Path, posix_backend: IOBackend
) -> None:
    path = tmp_path / "nvme"  # missing: created, its parent exists
    with NvmeTier(path, capacity=MIB, backend=posix_backend, scratch={"dtype": "bf16"}) as tier:
        fill(tier, "w", torch.ones(64, dtype=torch.bfloat16))
    assert read_marker(path) is not None and read_marker(path)["built_for"] == {"dtype": "bf16"}  # type: ignore[index]
    meta = json.loads((path / "w" / "zarr.json").read_text())
    assert meta["attributes"][SCRATCH_ATTR] is True
    (path / "notes.txt").write_text("mine")  # a user's file beside the scratch: kept
    with NvmeTier(path, capacity=MIB, backend=posix_backend, scratch={"dtype": "fp32"}) as tier:
        assert tier.names() == []  # the bf16 array is gone: nothing of it is adopted
        fill(tier, "w", torch.arange(64, dtype=torch.float32))
    assert read_marker(path)["built_for"] == {"dtype": "fp32"}  # type: ignore[index]
    assert (path / "notes.txt").read_text() == "mine"
    got = np.asarray(zarr.open_array(str(path / "w"), mode="r")[...])  # plain zarr reads it
    assert got.dtype.name == "float32" and got.tolist() == list(range(64))


@pytest.mark.parametrize("kind", ["plain store", "user file", "bad marker"])
def test_a_directory_that_is_not_scratch_is_refused_and_untouched(
    tmp_path: Path, posix_backend: IOBackend, kind: str
) -> None:
    path = tmp_path / "data"
    if kind == "plain store":  # a converted store or a checkpoint's array group
        with NvmeTier(path, capacity=MIB, backend=posix_backend) as tier:
            fill(tier, "w", torch.ones(8))
    else:
        path.mkdir()
        (path / "weights.bin").write_bytes(b"\x01" * 100)
        if kind == "bad marker":
            (path / MARKER_NAME).write_text("{not json")
    before = tree(path)
    with pytest.raises(ValueError) as err:
        NvmeTier(path, capacity=MIB, backend=posix_backend, scratch={})
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "choose an empty or new directory for nvme_path" in message
    assert tree(path) == before  # no lock file, no marker, nothing removed


def test_a_file_or_a_missing_parent_is_refused_in_one_line(
    tmp_path: Path, posix_backend: IOBackend
) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"^nvme_path '.*afile' is a file, not a directory: "):
        NvmeTier(tmp_path / "afile", capacity=MIB, backend=posix_backend, scratch={})
    assert (tmp_path / "afile").read_text() == "x"
    with pytest.raises(ValueError, match=r"parent directory '.*/no' does not exist either"):
        prepare_dir(tmp_path / "no" / "such")
    with pytest.raises(ValueError, match=r"afile/s': '.*/afile' is a file, not a directory"):
        prepare_dir(tmp_path / "afile" / "s")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_locked_scratch_directory_is_not_cleared(
    tmp_path: Path, posix_backend: IOBackend
) -> None:
    """A second run on the directory of one still running is refused before it clears."""
    path = tmp_path / "nvme"
    with NvmeTier(path, capacity=MIB, backend=posix_backend, scratch={"run": 1}) as tier:
        fill(tier, "w", torch.ones(8))
        with pytest.raises(StoreLockedError, match="locked by process"):
            NvmeTier(path, capacity=MIB, backend=posix_backend, scratch={"run": 2})
        assert tier.names() == ["w"] and (path / "w" / "zarr.json").is_file()
        assert read_marker(path)["built_for"] == {"run": 1}  # type: ignore[index]


def test_a_directory_another_rank_makes_meanwhile_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks prepare one shared directory at once: absent at this process's first look, made
    (and marked) by another before its next, it is taken, not refused as a file."""
    where = tmp_path / "nvme"
    real = Path.is_dir
    looks: list[Path] = []

    def is_dir(self: Path) -> bool:
        present = real(self)
        if self == where and not looks:  # the other rank makes it right after this look
            looks.append(self)
            where.mkdir()
            (where / "rank1").mkdir()
        return present

    monkeypatch.setattr(Path, "is_dir", is_dir)
    assert prepare_dir(where, owned=lambda name: name == "rank1") == where
    assert looks and real(where / "rank1")
    (tmp_path / "file").write_text("x")  # a file in its place is still refused
    with pytest.raises(ValueError, match="is a file, not a directory"):
        prepare_dir(tmp_path / "file")


def test_a_directory_another_rank_marks_meanwhile_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks prepare and mark one shared directory at once: unmarked at this process's look
    for the marker, marked by another rank before it lists the directory, it is taken (the
    marker is not a user's file); a user's file beside no marker is still refused."""
    where = tmp_path / "nvme"
    where.mkdir()
    real = scratch.read_marker
    looks: list[Path] = []

    def read_once_late(path: Path, *, key: str = "nvme_path") -> dict[str, object] | None:
        if not looks:  # this rank's first look; the other rank marks it right after
            looks.append(Path(path))
            found = real(path, key=key)
            scratch.write_marker(where, {"world_size": 2})
            return found
        return real(path, key=key)

    monkeypatch.setattr(scratch, "read_marker", read_once_late)
    assert prepare_dir(where, owned=lambda name: name == "rank1") == where
    assert looks == [where] and read_marker(where) is not None
    other = tmp_path / "users"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="holds 1 entries"):
        prepare_dir(other)
