"""Rates of undisturbed model-shaped probes, remembered per machine and pass shape.

A model-shaped probe (:mod:`bb_lightning.probe.calibrate`) that runs beside a busy
neighbour is slowed more than the matrix products timed beside it: its many short
parallel regions wait for a thread the neighbour displaced, so rating it against those
products still prices the plan too slow. Each undisturbed probe therefore records its
rates here, and a disturbed probe of the same model and shape on the same machine takes
the recorded ones instead.

The records are one JSON file, ``model-rates.json`` in ``$BB_CACHE_DIR`` (default
``~/.cache/balance_beam``, beside the hardware profiles), keyed by the machine
(hostname, CPU model, GPU name), the model's shape and the pass's shape. Rates are FLOP/s
of the model's own FLOPs, so they hold whatever matrix-product rate a later hardware
profile measures. A file that cannot be read or written is ignored: the probe then
behaves as without records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from bb_lightning.planner.profile import ModelProfile
from bb_lightning.probe.measure import cache_dir, machine_identity

__all__ = ["FILE_NAME", "key", "recall", "remember"]

FILE_NAME = "model-rates.json"
"""Name of the records file in the cache directory."""


def _path() -> Path:
    return cache_dir() / FILE_NAME


def key(kind: str, model: ModelProfile, **shape: object) -> str:
    """The record key of a ``kind`` probe (``"train"``, ``"predict"``) of ``model`` at
    ``shape`` (sequence length, batch rows, dtype, device) on this machine."""
    parts = {
        "kind": kind,
        "machine": machine_identity(None),
        "model": [
            model.num_blocks,
            model.hidden_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            model.vocab_size,
            model.block_params,
            model.num_experts,
            model.experts_per_token,
        ],
        "shape": {k: str(v) for k, v in sorted(shape.items())},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _load() -> dict[str, dict[str, float]]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recall(record: str) -> dict[str, float] | None:
    """The rates (FLOP/s by name) recorded under ``record``, or None."""
    found = _load().get(record)
    if not isinstance(found, dict):
        return None
    rates = {k: float(v) for k, v in found.items() if isinstance(v, int | float) and v > 0}
    return rates or None


def remember(record: str, rates: dict[str, float]) -> None:
    """Record ``rates`` (FLOP/s by name) under ``record``, replacing what was there; the
    file is replaced atomically, and an error leaves it as it was."""
    path = _path()
    data = _load()
    data[record] = {k: float(v) for k, v in rates.items()}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{FILE_NAME}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
