"""Stream predictions to a JSONL file as batches finish, and resume a stopped run.

:class:`JsonlPredictionWriter` appends one line per prompt after every
predict batch (``{"id", "text"?, "token_ids", "finish_reason"?}``, or
``{"id", "error"}`` for a prompt that could not run), then flushes and fsyncs
the file: a run killed at any point loses at most the batch in flight.

On ``setup`` an existing file is recovered: a half-written last line (no
newline: the process died mid-write) is cut off, and the ids already written
are handed to the data module (``skip_ids``, see
:class:`~bb_lightning.data.PromptsDataModule`) so the restarted run only
generates the rest. Ids already in the file are never written twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = ["JsonlPredictionWriter", "recover_jsonl"]


def recover_jsonl(path: str | os.PathLike[str]) -> set[str]:
    """Ids of the complete lines of a predictions file; cuts a half-written last line.

    Raises ``ValueError`` naming ``file:line`` for a complete line that is not a JSON
    object with an ``"id"`` (the file is not a predictions file, or was edited).
    """
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    ids: set[str] = set()
    for lineno, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line, or write "
                "predictions to a new file"
            ) from e
        if not isinstance(row, dict) or "id" not in row:
            raise ValueError(
                f"{path}:{lineno}: a predictions line must be a JSON object with an 'id'; "
                "write predictions to a new file"
            )
        ids.add(str(row["id"]))
    return ids


class JsonlPredictionWriter(BasePredictionWriter):
    """Appends each predict batch's records to a JSONL file, durably, skipping written ids."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        """Write to ``path`` (created with its parent directory when absent).

        Args:
            path: the JSONL file; an existing one is resumed, not overwritten.
            fsync: ``os.fsync`` after each batch (off only for throwaway runs).
        """
        super().__init__(write_interval="batch")
        self.path = Path(path)
        self.fsync = fsync
        self.written: set[str] = set()
        """Ids in the file (found at setup or written since)."""
        self._file: IO[str] | None = None
        self._ready = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Recover the file and tell the data module what to skip (opened at the first write,
        so a run that fails before its first batch leaves no file)."""
        if stage != "predict":
            return
        self.written = recover_jsonl(self.path)
        self._ready = True
        datamodule = getattr(trainer, "datamodule", None)
        skip = getattr(datamodule, "skip_ids", None)
        if callable(skip) and self.written:
            skip(self.written)

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Append the batch's records (a list of dicts with an ``"id"``), flush and fsync."""
        self.write_records(prediction)

    def write_records(self, records: Sequence[dict[str, Any]]) -> None:
        """Append records whose id is not written yet, as one durable write."""
        if not self._ready:
            raise RuntimeError("JsonlPredictionWriter is not set up: run it through predict")
        lines = []
        for record in records:
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(
                    f"prediction {record!r} is not a dict with an 'id': return one dict per "
                    "prompt from predict_step"
                )
            rid = str(record["id"])
            if rid not in self.written:
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                self.written.add(rid)
        if not lines:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write("".join(lines))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the file."""
        self._ready = False
        if self._file is not None:
            self._file.close()
            self._file = None
