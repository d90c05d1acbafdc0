"""Lightning's trainer state in a checkpoint, stored so that loading it never runs code.

Three files in the checkpoint directory:

* ``trainer_state.json`` — the whole structure: loops, counters, callback and scheduler
  states, hyperparameters. Dicts with string keys, lists, strings, numbers, booleans and
  ``None`` are plain JSON; tuples, dicts with other keys and Lightning's ``AttributeDict``
  are tagged objects ``{"__bb__": kind, ...}``; a tensor is a reference into
* ``trainer_state.safetensors`` — every tensor of the state (safetensors holds no code);
* ``trainer_state.pt`` — only when some value is none of the above (a ``pathlib.Path``,
  an ``argparse.Namespace``...): those values, read back with ``torch.load(weights_only=True)``
  under the allowlist :data:`SAFE_GLOBALS` (plus what the user registered with
  ``torch.serialization.add_safe_globals``). A value that would need any other code to load
  is refused when the checkpoint is saved, with its key named.

:func:`read` loads these, or the single pickled ``trainer_state.pt`` of a version 1
checkpoint under the same allowlist; a file that would run code raises :class:`ValueError`
naming the file and the type it asked for.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from storage.nvme import write_synced

__all__ = ["JSON_NAME", "PICKLE_NAME", "SAFE_GLOBALS", "TENSORS_NAME", "UnsafeStateError"]
__all__ += ["read", "write"]

JSON_NAME = "trainer_state.json"
TENSORS_NAME = "trainer_state.safetensors"
PICKLE_NAME = "trainer_state.pt"
TAG = "__bb__"

SAFE_GLOBALS: list[Any] = [
    AttributeDict,
    argparse.Namespace,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.WindowsPath,
    pathlib.PureWindowsPath,
]
"""Types ``trainer_state.pt`` may hold: data-only classes whose unpickling runs no user code."""


class UnsafeStateError(ValueError):
    """A trainer state file that would run code when loaded, or a value that would need to."""


class _Encoder:
    """Turns a state into JSON-able data, collecting tensors and other values on the side."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.others: dict[str, Any] = {}

    def encode(self, value: Any, where: str) -> Any:
        if value is None or type(value) in (bool, int, float, str):
            return value
        if type(value) is dict and all(isinstance(k, str) and k != TAG for k in value):
            return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
        if type(value) is list:
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is tuple:
            return {TAG: "tuple", "items": self.encode(list(value), where)}
        if type(value) in (dict, AttributeDict):
            items = [
                [self.encode(k, where), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()
            ]
            kind = "dict" if type(value) is dict else "AttributeDict"
            return {TAG: kind, "items": items}
        if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout is torch.strided:
            key = f"t{len(self.tensors)}"
            self.tensors[key] = value.detach().cpu().contiguous().clone()
            return {TAG: "tensor", "key": key}
        key = f"p{len(self.others)}"
        self.others[key] = (where, value)
        return {TAG: "pickled", "key": key}


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], others: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, others) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: _decode(v, tensors, others) for k, v in value.items()}
    if kind == "tuple":
        return tuple(_decode(value["items"], tensors, others))
    if kind in ("dict", "AttributeDict"):
        pairs = {
            _decode(k, tensors, others): _decode(v, tensors, others) for k, v in value["items"]
        }
        return pairs if kind == "dict" else AttributeDict(pairs)
    if kind == "tensor":
        return tensors[value["key"]]
    if kind == "pickled":
        return others[value["key"]]
    raise UnsafeStateError(f"{JSON_NAME}: unknown tagged value {value!r}: the file is damaged")


def _safe_load(data: bytes | os.PathLike[str] | str, name: str) -> Any:
    """``torch.load(weights_only=True)`` under :data:`SAFE_GLOBALS`; refusals name the file."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError for refused globals
        first = str(exc).strip().splitlines()
        reason = next(
            (line for line in first if "global" in line.lower()), first[0] if first else ""
        )
        raise UnsafeStateError(
            f"{name}: refused to load: it would need code that is not allowlisted to load "
            f"({reason.strip()}); balance_beam never runs code from a checkpoint: if the file is "
            f"yours and the type is data only, register it with "
            f"torch.serialization.add_safe_globals([...]) first"
        ) from exc


def write(directory: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` as the trainer state files of checkpoint directory ``directory``."""
    enc = _Encoder()
    doc = enc.encode(dict(state), "trainer_state")
    if enc.others:
        payload = {k: v for k, (_, v) in enc.others.items()}
        buf = io.BytesIO()
        torch.save(payload, buf)
        try:
            _safe_load(buf.getvalue(), PICKLE_NAME)
        except UnsafeStateError:
            bad = ", ".join(
                f"{w} ({type(v).__module__}.{type(v).__qualname__})" for w, v in enc.others.values()
            )
            raise UnsafeStateError(
                f"the trainer state holds values a checkpoint cannot store without running code "
                f"when it is loaded: {bad}: make them numbers, strings, lists, dicts or tensors, "
                f"or register their types with torch.serialization.add_safe_globals([...])"
            ) from None
        write_synced(directory / PICKLE_NAME, buf.getvalue())
    if enc.tensors:
        save_file(enc.tensors, str(directory / TENSORS_NAME))
        fd = os.open(directory / TENSORS_NAME, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    write_synced(directory / JSON_NAME, json.dumps({"state": doc}, indent=1).encode())


def read(directory: Path, version: int) -> dict[str, Any]:
    """The trainer state of checkpoint directory ``directory`` (format ``version``)."""
    if version < 2:
        state = _safe_load(directory / PICKLE_NAME, str(directory / PICKLE_NAME))
        if not isinstance(state, dict):
            raise UnsafeStateError(f"{directory / PICKLE_NAME} holds a {type(state)}, not a dict")
        return state
    try:
        doc = json.loads((directory / JSON_NAME).read_text(encoding="utf-8"))["state"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UnsafeStateError(
            f"{directory / JSON_NAME}: unreadable trainer state: {exc!r}"
        ) from exc
    tensors: dict[str, torch.Tensor] = {}
    if (directory / TENSORS_NAME).exists():
        try:
            tensors = load_file(str(directory / TENSORS_NAME))
        except SafetensorError as exc:
            raise UnsafeStateError(
                f"{directory / TENSORS_NAME}: unreadable trainer state tensors ({exc}): "
                "the file is truncated or corrupt; resume from another checkpoint"
            ) from None
    others: dict[str, Any] = {}
    if (directory / PICKLE_NAME).exists():
        others = _safe_load(directory / PICKLE_NAME, str(directory / PICKLE_NAME))
        if not isinstance(others, dict):
            raise UnsafeStateError(
                f"{directory / PICKLE_NAME} holds a {type(others).__name__}, not a dict: the "
                "file is damaged; resume from another checkpoint"
            )
    try:
        state = _decode(doc, tensors, others)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise UnsafeStateError(
            f"{directory / JSON_NAME}: damaged trainer state ({type(exc).__name__}: {exc}): "
            "resume from another checkpoint"
        ) from None
    if not isinstance(state, dict):
        raise UnsafeStateError(
            f"{directory / JSON_NAME}: the state is a {type(state).__name__}, not an object: "
            "the file is damaged; resume from another checkpoint"
        )
    return state
