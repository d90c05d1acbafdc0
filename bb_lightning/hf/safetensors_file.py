"""Open a ``.safetensors`` file, naming the file when it is truncated or corrupt."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["SafetensorsFileError", "open_safetensors"]


class SafetensorsFileError(ValueError):
    """A ``.safetensors`` file whose header or data cannot be read."""


@contextmanager
def open_safetensors(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``safetensors.safe_open(path, framework="pt")``; :class:`SafetensorsFileError` if unreadable.

    The Rust reader reports a damaged file as ``SafetensorError: Error while deserializing
    header: ...`` without its name; this names the file and the fix.
    """
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise SafetensorsFileError(
            f"{os.fspath(path)} is not a readable safetensors file ({err}): it is truncated or "
            "corrupt; copy it again or write it again with save_pretrained"
        ) from None
    with handle as f:
        yield f
