"""Stream predictions to a JSONL file as batches finish, and resume a stopped run.

:class:`JsonlPredictionWriter` appends one line per prompt after every
predict batch (``{"id", "text"?, "token_ids", "finish_reason"?, "prompt_digest"?}``, or
``{"id", "error"}`` for a prompt that could not run), then flushes and fsyncs
the file: a run killed at any point loses at most the batch in flight.

On ``setup`` an existing file is recovered: a half-written last line (no
newline: the process died mid-write) is cut off, and the ids already written
are handed to the data module (``skip_ids``, see
:class:`~bb_lightning.data.PromptsDataModule`) so the restarted run only
generates the rest. Ids already in the file are never written twice. Where the data
module's records carry a ``digest`` of their prompt (``PromptsDataModule`` does), each line
records it as ``prompt_digest``, and a resumed run whose prompts file gives a written id
another prompt (a line inserted before rows numbered by their line, an edited prompt) is
refused in one line naming the id, the predictions file and the prompts line, instead of
keeping the old line for the new prompt.

With a world size above 1 each rank appends to its own shard file
(:func:`shard_path`, ``<output>.rank<r>-of-<n>.jsonl``) and, after a barrier,
rank 0 merges the output file and every shard file into the output in input
order (:func:`merge_shards`). A restart at any world size skips the ids found
in the output and in every shard file, of whatever world size.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = [
    "JsonlPredictionWriter",
    "find_shards",
    "merge_shards",
    "read_jsonl",
    "recover_jsonl",
    "shard_path",
]

_SHARD = re.compile(r"\.rank(\d+)-of-(\d+)\.jsonl$")


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
    return {str(row["id"]) for row in _rows(path, data[:end])}


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete lines of a predictions file, in file order; a half-written last line is
    left out (the file is not changed). Raises ``ValueError`` as :func:`recover_jsonl`."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    return _rows(path, data[: data.rfind(b"\n") + 1])


def _rows(path: Path, data: bytes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line, or write "
                "predictions to a new file"
            ) from e
        except (ValueError, RecursionError) as e:  # not UTF-8, a huge integer, deep nesting
            why = str(e).partition("\n")[0] or type(e).__name__
            raise ValueError(
                f"{path}:{lineno}: not a predictions line ({why}); write predictions to a new file"
            ) from None
        if not isinstance(row, dict) or "id" not in row:
            raise ValueError(
                f"{path}:{lineno}: a predictions line must be a JSON object with an 'id'; "
                "write predictions to a new file"
            )
        rows.append(row)
    return rows


def shard_path(output: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The file rank ``rank`` of ``world_size`` writes: ``<output>.rank<r>-of-<n>.jsonl``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} of world_size={world_size}: need world_size >= 1 and "
            "0 <= rank < world_size"
        )
    output = Path(output)
    return output.with_name(f"{output.name}.rank{rank}-of-{world_size}.jsonl")


def find_shards(output: str | os.PathLike[str]) -> list[Path]:
    """The shard files of ``output`` on disk, of any world size, sorted by (world size, rank)."""
    output = Path(output)
    found: list[tuple[int, int, Path]] = []
    if output.parent.is_dir():
        for p in output.parent.iterdir():
            if p.name.startswith(output.name + ".") and p.is_file():
                m = _SHARD.fullmatch(p.name[len(output.name) :])
                if m is not None:
                    found.append((int(m.group(2)), int(m.group(1)), p))
    return [p for _, _, p in sorted(found)]


def merge_shards(
    output: str | os.PathLike[str],
    order: Sequence[str] | None = None,
    *,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
    fsync: bool = True,
) -> int | None:
    """Merge the shard files of ``output`` into ``output``, on rank 0, between two barriers.

    Every rank calls it: ``barrier()`` (when given) waits until all ranks stopped writing;
    then rank 0 reads ``output`` and every shard file (any world size; a half-written last
    line is left out), keeps the first record of each id, writes them in ``order`` (the
    prompts file's ids; ids not in it follow in the order read) to a temporary file,
    fsyncs it, renames it over ``output`` and removes the shard files; a second
    ``barrier()`` holds the other ranks until the merged file is in place. A run killed
    at any point leaves files a resumed run recovers. Returns the records in ``output``
    on rank 0, None on the others.
    """
    if barrier is not None:
        barrier()
    merged: int | None = None
    if rank == 0:
        merged = _merge(Path(output), order, fsync=fsync)
    if barrier is not None:
        barrier()
    return merged


def _merge(output: Path, order: Sequence[str] | None, *, fsync: bool) -> int:
    shards = find_shards(output)
    first: dict[str, dict[str, Any]] = {}
    duplicates = False
    for path in [output, *shards]:
        for row in read_jsonl(path):
            duplicates |= first.setdefault(str(row["id"]), row) is not row
    position = {rid: i for i, rid in enumerate(order or ())}
    ids = sorted(first, key=lambda rid: position.get(rid, len(position)))  # stable
    clean = not output.exists() or output.read_bytes().endswith(b"\n")
    if not shards and not duplicates and clean and ids == list(first):
        return len(ids)  # nothing to merge: leave the file (or its absence) as it is
    for stale in output.parent.glob(f".{glob.escape(output.name)}.merge-*.tmp"):
        stale.unlink(missing_ok=True)  # from a merge killed before its rename
    tmp = output.with_name(f".{output.name}.merge-{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(json.dumps(first[rid], ensure_ascii=False) + "\n" for rid in ids))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, output)
    if fsync:
        _fsync_dir(output.parent)
    for path in shards:
        path.unlink(missing_ok=True)
    return len(ids)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class JsonlPredictionWriter(BasePredictionWriter):
    """Appends each predict batch's records to a JSONL file, durably, skipping written ids."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        """Write to ``path`` (created with its parent directory when absent).

        Args:
            path: the JSONL file; an existing one is resumed, not overwritten.
            fsync: ``os.fsync`` after each batch (off only for throwaway runs).
            rank: this process's rank; None takes ``trainer.global_rank``.
            world_size: processes writing ``path``; None takes ``trainer.world_size``.
                Above 1 this rank writes :func:`shard_path` and rank 0 merges at the end.
            barrier: waits for every rank (before and after the merge); None takes
                ``trainer.strategy.barrier``.
        """
        super().__init__(write_interval="batch")
        self.output = Path(path)
        """The merged predictions file."""
        self.path = self.output
        """The file this rank appends to: ``output``, or its shard when the world size > 1."""
        self.fsync = fsync
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.written: set[str] = set()
        """Ids in the files (found at setup or written since)."""
        self._file: IO[str] | None = None
        self._ready = False
        self._merge = False
        self._rank = 0
        self._order: list[str] | None = None
        self._digests: dict[str, str] = {}
        self._lines: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Recover the files and tell the data module what to skip and which share to run
        (opened at the first write, so a run that fails before its first batch leaves no
        file)."""
        if stage != "predict":
            return
        if self.output.is_dir():
            raise ValueError(
                f"predictions file {self.output} is a directory: give a file name, e.g. "
                f"{self.output / 'predictions.jsonl'}"
            )
        rank = trainer.global_rank if self.rank is None else self.rank
        world = trainer.world_size if self.world_size is None else self.world_size
        shard = shard_path(self.output, rank, world)  # checks the rank
        self.path = shard if world > 1 else self.output
        self._rank = rank
        datamodule = getattr(trainer, "datamodule", None)
        records = getattr(datamodule, "records", None)
        if isinstance(records, list):
            self._digests = {str(r["id"]): r["digest"] for r in records if "digest" in r}
            self._lines = {str(r["id"]): r["line"] for r in records if "line" in r}
        recover_jsonl(self.path)
        shards = find_shards(self.output)
        self.written = set()
        for path in dict.fromkeys([self.path, self.output, *shards]):  # others: read, never cut
            for row in read_jsonl(path):
                self._check_prompt(path, row)
                self.written.add(str(row["id"]))
        self._merge = world > 1 or bool(shards)
        self._ready = True
        skip = getattr(datamodule, "skip_ids", None)
        if callable(skip) and self.written:
            skip(self.written)
        share = getattr(datamodule, "use_share", None)
        if callable(share):
            share(rank, world)
        self._order = [str(r["id"]) for r in records] if isinstance(records, list) else None

    def _check_prompt(self, path: Path, row: dict[str, Any]) -> None:
        """Refuse a written line whose recorded prompt digest is not its id's prompt now."""
        rid = str(row["id"])
        was, now = row.get("prompt_digest"), self._digests.get(rid)
        if was is not None and now is not None and was != now:
            where = f" (line {self._lines[rid]})" if rid in self._lines else ""
            raise ValueError(
                f"{path} holds a prediction for id {rid!r} made for another prompt than the "
                f"prompts file gives that id now{where}: the prompts changed since that run; "
                "write to a new predictions file, or remove the old one to start over"
            )

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
                digest = self._digests.get(rid)
                if digest is not None and "prompt_digest" not in record:
                    record = {**record, "prompt_digest": digest}
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
        """Close the file; after a predict run with shard files, merge them into ``output``
        (:func:`merge_shards`). Lightning calls this on every rank once the run succeeded,
        also on a rank whose share was empty (it runs no predict hooks), so the barriers
        match."""
        self._ready = False
        self._close()
        if stage != "predict" or not self._merge:
            return
        self._merge = False

        def strategy_barrier() -> None:
            trainer.strategy.barrier("bb_lightning.data.writer.merge")

        merge_shards(
            self.output,
            self._order,
            rank=self._rank,
            barrier=self.barrier or strategy_barrier,
            fsync=self.fsync,
        )

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
