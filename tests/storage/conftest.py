"""Shared fixtures of the storage tests: a POSIX backend and tensor <-> byte buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from storage.io import IOBackend, IOConfig, aligned_empty, open_backend


@pytest.fixture
def posix_backend() -> Iterator[IOBackend]:
    """A POSIX backend with small tasks, so that transfers split into many of them."""
    backend = open_backend(IOConfig(backend="posix", threads=3, task_size=64 << 10))
    yield backend
    backend.close()


def _to_buffer(t: torch.Tensor) -> torch.Tensor:
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    buf = aligned_empty(raw.numel())
    buf[: raw.numel()] = raw
    return buf


def _from_buffer(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buf[:nbytes].view(like.dtype).reshape(like.shape).clone()


@pytest.fixture
def to_buffer() -> Callable[[torch.Tensor], torch.Tensor]:
    """Copy a tensor's bytes into a fresh aligned ``uint8`` buffer."""
    return _to_buffer


@pytest.fixture
def from_buffer() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Reinterpret the start of a buffer as a tensor shaped and typed like ``like``."""
    return _from_buffer
