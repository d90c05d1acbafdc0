"""Lightning data modules: packed text for training, prompt batches for bulk generation.

:class:`TextDataModule` reads ``.txt`` files (one document each) and ``.jsonl``
files (one document per row, in its ``"text"`` field), tokenises the
documents in file order, appends the eos token to each, concatenates them and
cuts the stream into rows of ``seq_len`` tokens (the tail shorter than a row
is dropped). Training batches are ``{"input_ids": LongTensor[batch, seq_len]}``.

:class:`PromptsDataModule` reads a ``.jsonl`` of ``{"id", "prompt"}`` rows and
yields left-padded batches for ``predict``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from bb_lightning.bounds import check_int, check_number
from bb_lightning.data.documents import (
    pack_documents,
    prompt_digest,
    prompt_rows,
    read_documents,
    resolve_files,
    row_ids,
)
from bb_lightning.data.tokenizer import ByteTokenizer, Tokenizer, encode_text, load_tokenizer
from bb_lightning.data.tokenizer import pad_id as tokenizer_pad_id

__all__ = [
    "PromptsDataModule",
    "SeededSampler",
    "TextDataModule",
    "pack_documents",
    "prompt_digest",
    "read_documents",
    "resolve_files",
]


MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))
"""Most DataLoader worker processes a data module starts (four per core, at least 8)."""


def check_text_settings(
    *,
    seq_len: int,
    batch_size: int,
    val_fraction: float,
    max_files: int | None,
    max_tokens: int | None,
    seed: int,
    num_workers: int,
) -> None:
    """Refuse :class:`TextDataModule` settings out of range, one line naming the value."""
    check_int("seq_len", seq_len, low=1, what="tokens per row", example=512)
    check_int("batch_size", batch_size, low=1, what="rows per batch", example=8)
    check_number("val_fraction", val_fraction, low=0.0, high=1.0, high_open=True,
                 what="share of rows held out; 0: none", example=0.05)  # fmt: skip
    check_int("max_files", max_files, low=1, what="files read", example=100,
              none="every file")  # fmt: skip
    check_int("max_tokens", max_tokens, low=seq_len, what="tokens used, at least seq_len",
              example=max(seq_len, 1_000_000), none="every token")  # fmt: skip
    check_int("seed", seed, low=0, high=2**63 - 1, what="seed of the split and the order",
              example=0)  # fmt: skip
    check_int("num_workers", num_workers, low=0, high=MAX_WORKERS,
              what="DataLoader worker processes", example=2)  # fmt: skip


def check_prompts_settings(
    *, batch_size: int | None, max_prompt_len: int, num_workers: int
) -> None:
    """Refuse :class:`PromptsDataModule` settings out of range, one line naming the value."""
    check_int("batch_size", batch_size, low=1, what="prompts per batch", example=16,
              none="the plan's")  # fmt: skip
    check_int("max_prompt_len", max_prompt_len, low=1, what="tokens of the longest prompt",
              example=2048)  # fmt: skip
    check_int("num_workers", num_workers, low=0, high=MAX_WORKERS,
              what="DataLoader worker processes", example=2)  # fmt: skip


class SeededSampler(Sampler[int]):
    """Indices in an order fixed by ``(seed, epoch)``, so a resumed run replays it.

    Lightning calls :meth:`set_epoch` at the start of each epoch.
    """

    def __init__(self, size: int, *, seed: int, shuffle: bool = True) -> None:
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of epoch ``epoch`` (0-based)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=gen).tolist())

    def __len__(self) -> int:
        return self.size


class _Rows(Dataset[dict[str, Tensor]]):
    def __init__(self, rows: Tensor, indices: Tensor) -> None:
        self.rows = rows
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.rows[int(self.indices[i])].long()}


class TextDataModule(pl.LightningDataModule):
    """Packed causal-LM training data from ``.txt`` and ``.jsonl`` files.

    Rows are split into train and validation by a permutation seeded with
    ``seed``; the training order of each epoch depends only on ``seed`` and
    the epoch. With ``cache_dir`` the packed rows are stored there (keyed by
    file names, sizes, modification times and the settings) and reused;
    without it nothing is written anywhere.
    """

    def __init__(
        self,
        paths: str | list[str],
        *,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 1,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        max_tokens: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        """Configure the module; files are read in :meth:`setup`.

        Args:
            paths: glob pattern(s) of ``.txt`` / ``.jsonl`` files.
            tokenizer: ``None``/``"byte"`` for :class:`ByteTokenizer`, else a HF tokenizer.
            seq_len: tokens per row.
            batch_size: rows per batch.
            val_fraction: share of rows held out for validation, in [0, 1).
            max_files: read at most this many files (after sorting).
            max_tokens: use at most this many tokens of the packed stream.
            seed: seed of the train/validation split and of the shuffling.
            num_workers: DataLoader worker processes.
            cache_dir: directory for the packed-rows cache; ``None`` caches nothing.
        """
        super().__init__()
        check_text_settings(
            seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction,
            max_files=max_files, max_tokens=max_tokens, seed=seed, num_workers=num_workers,
        )  # fmt: skip
        self.save_hyperparameters()
        self.paths = paths
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_files = max_files
        self.max_tokens = max_tokens
        self.seed = seed
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.rows: Tensor | None = None
        """Packed rows ``[rows, seq_len]`` in stream order (int32), after :meth:`setup`."""
        self.train_indices: Tensor | None = None
        self.val_indices: Tensor | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (a model's vocabulary must be at least this)."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.vocab_size
        return len(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        """Read, tokenise and pack the files once; split rows into train and validation."""
        if self.rows is not None:
            return
        files = resolve_files(self.paths, self.max_files)
        self.rows = self._load_cached(files)
        n = len(self.rows)
        n_val = round(n * self.val_fraction)
        if self.val_fraction > 0.0 and n >= 2:
            n_val = min(max(n_val, 1), n - 1)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        self.val_indices = perm[:n_val].sort().values
        self.train_indices = perm[n_val:].sort().values

    def _load_cached(self, files: list[Path]) -> Tensor:
        if self.cache_dir is None:
            return pack_documents(files, self.tokenizer, self.seq_len, self.max_tokens)
        stats = [(os.path.realpath(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key = json.dumps(
            [stats, self.tokenizer_name or "byte", self.seq_len, self.max_tokens], sort_keys=True
        )
        cache = Path(self.cache_dir) / f"packed-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"
        if cache.exists():
            return torch.from_numpy(np.load(cache))
        rows = pack_documents(files, self.tokenizer, self.seq_len, self.max_tokens)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, rows.numpy())
        os.replace(tmp, cache)
        return rows

    def _loader(self, indices: Tensor | None, *, shuffle: bool) -> DataLoader[dict[str, Tensor]]:
        if self.rows is None or indices is None:
            raise RuntimeError("TextDataModule.setup() must run before its dataloaders")
        data = _Rows(self.rows, indices)
        sampler = SeededSampler(len(data), seed=self.seed, shuffle=shuffle)
        return DataLoader(
            data, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers
        )

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        """Training rows, reshuffled each epoch by ``(seed, epoch)``."""
        return self._loader(self.train_indices, shuffle=True)

    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        """Validation rows in stream order (empty when ``val_fraction`` is 0)."""
        return self._loader(self.val_indices, shuffle=False)


class PromptsDataModule(pl.LightningDataModule):
    """Prompts for bulk generation from a ``.jsonl`` of ``{"id": ..., "prompt": ...}`` rows.

    Each row is one prompt and keeps it: the predictions are keyed by id, so ids are
    unique. ``id`` is a string or an integer (read as its decimal string); an id given
    on two lines is refused before anything runs, naming both lines. A row without an
    id (or with ``null``) gets its 1-based line number, ``"7"``, or ``"line-7"`` where
    another row gives ``"7"`` (``"line-7-2"``, ... where that is given too). Batches are
    ``{"id": list[str], "input_ids": LongTensor[b, s], "attention_mask":
    LongTensor[b, s], "error": list[str | None]}``, left-padded. A prompt
    longer than ``max_prompt_len`` tokens, or one that encodes to no token,
    does not stop the run: its ``error`` entry says why and its row is all
    padding with an all-zero attention mask; consumers skip such rows and
    report the error for that id.
    """

    def __init__(
        self,
        path: str,
        *,
        tokenizer: str | None = None,
        batch_size: int | None = 1,
        max_prompt_len: int = 2048,
        num_workers: int = 0,
    ) -> None:
        """Configure the module; the file is read in :meth:`setup`.

        Args:
            path: the ``.jsonl`` file.
            tokenizer: ``None``/``"byte"`` for :class:`ByteTokenizer`, else a HF tokenizer
                (which adds its own special tokens, e.g. bos).
            batch_size: prompts per batch; None takes the planner's concurrent sequences
                (a planning strategy such as ``balance_beam`` calls
                :meth:`use_planned_batch_size` before the batches are drawn).
            max_prompt_len: longest prompt accepted (tokens).
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        check_prompts_settings(
            batch_size=batch_size, max_prompt_len=max_prompt_len, num_workers=num_workers
        )
        self.save_hyperparameters()
        self.path = Path(path)
        self.batch_size = batch_size
        self.planned_batch_size: int | None = None
        """Prompts per batch chosen by the planner (used when ``batch_size`` is None)."""
        self.max_prompt_len = max_prompt_len
        self.num_workers = num_workers
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.records: list[dict[str, Any]] | None = None
        """One ``{"id", "input_ids", "error", "line", "digest"}`` per prompt (``line``: its
        1-based line number; ``digest``: :func:`prompt_digest` of its text), in file order,
        after :meth:`setup`."""
        self.skipped: frozenset[str] = frozenset()
        """Ids left out of :meth:`predict_dataloader` (already predicted, see :meth:`skip_ids`)."""
        self.rank = 0
        """This process's share of the pending prompts is ``pending[rank::world_size]``."""
        self.world_size = 1

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenise the prompts once.

        Raises ValueError naming ``file:line`` for a row that is not a JSON object with a
        string ``"prompt"``, an ``"id"`` that is not a string or an integer, or an id
        given on two lines (both named).
        """
        if self.records is not None:
            return
        if self.path.is_dir():
            raise ValueError(
                f"prompts file {self.path} is a directory: give the .jsonl file in it, e.g. "
                f"{self.path / 'prompts.jsonl'}"
            )
        if not self.path.is_file():
            raise ValueError(f"prompts file {self.path} does not exist")
        special = not isinstance(self.tokenizer, ByteTokenizer)
        rows = prompt_rows(self.path)
        if not rows:
            raise ValueError(f"prompts file {self.path} holds no prompt: add jsonl rows")
        records: list[dict[str, Any]] = []
        for (lineno, (_, prompt)), rid in zip(rows.items(), row_ids(self.path, rows), strict=True):
            ids = encode_text(self.tokenizer, prompt, add_special_tokens=special)
            error = None
            if not ids:
                error = "prompt encodes to 0 tokens"
            elif len(ids) > self.max_prompt_len:
                error = f"prompt has {len(ids)} tokens > max_prompt_len={self.max_prompt_len}"
            records.append(
                {"id": rid, "input_ids": ids, "error": error, "line": lineno,
                 "digest": prompt_digest(prompt)}
            )  # fmt: skip
        self.records = records

    def collate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-pad a list of records into one batch (see the class docstring)."""
        pad = tokenizer_pad_id(self.tokenizer)
        valid = [len(r["input_ids"]) for r in records if r["error"] is None]
        width = max(valid, default=1)
        input_ids = torch.full((len(records), width), pad, dtype=torch.long)
        mask = torch.zeros((len(records), width), dtype=torch.long)
        for i, r in enumerate(records):
            if r["error"] is None:
                n = len(r["input_ids"])
                input_ids[i, width - n :] = torch.tensor(r["input_ids"], dtype=torch.long)
                mask[i, width - n :] = 1
        return {
            "id": [r["id"] for r in records],
            "input_ids": input_ids,
            "attention_mask": mask,
            "error": [r["error"] for r in records],
        }

    def skip_ids(self, ids: Collection[str]) -> None:
        """Leave prompts with these ids out of the batches (a resumed run's finished ones)."""
        self.skipped = frozenset(str(i) for i in ids)

    def use_share(self, rank: int, world_size: int) -> None:
        """Run only ``pending[rank::world_size]`` of the prompts not skipped (data parallel)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank} of world_size={world_size}: need world_size >= 1 and "
                "0 <= rank < world_size"
            )
        self.rank, self.world_size = rank, world_size

    def _pending(self) -> list[dict[str, Any]]:
        if self.records is None:
            raise RuntimeError("PromptsDataModule.setup() must run before its dataloaders")
        return [r for r in self.records if r["id"] not in self.skipped]

    @property
    def num_prompts(self) -> int:
        """Prompts still to run (not skipped, no error), after :meth:`setup`."""
        return sum(r["error"] is None for r in self._pending())

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt still to run (1 when none), after :meth:`setup`."""
        return max((len(r["input_ids"]) for r in self._pending() if r["error"] is None),
                   default=1)  # fmt: skip

    def use_planned_batch_size(self, concurrent_seqs: int) -> None:
        """Run batches of ``concurrent_seqs`` prompts when ``batch_size`` is None."""
        if concurrent_seqs < 1:
            raise ValueError(f"concurrent_seqs={concurrent_seqs} must be >= 1 prompts")
        self.planned_batch_size = concurrent_seqs

    def predict_dataloader(self) -> DataLoader[dict[str, Any]]:
        """Prompt batches in file order, without the ids given to :meth:`skip_ids`; with a
        world size above 1 (:meth:`use_share`) this rank's strided share of them."""
        records = self._pending()
        batch_size = self.batch_size or self.planned_batch_size
        if batch_size is None:
            raise ValueError(
                "PromptsDataModule(batch_size=None) takes its batch size from a planning "
                "strategy, but none was set: pass batch_size= or use strategy='balance_beam'"
            )
        return DataLoader(
            records,  # type: ignore[arg-type]
            batch_size=batch_size,
            shuffle=False,
            sampler=_share_sampler(records, self.rank, self.world_size),
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )


class _StridedShare(DistributedSampler[Any]):
    """Indices ``rank, rank + n, ...`` of a dataset, none repeated (a rank may get none).

    A :class:`DistributedSampler`, so Lightning does not put its own around it; it strides
    as Lightning's ``UnrepeatedDistributedSampler`` does, which refuses an empty share.
    """

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        self.num_samples = len(range(rank, len(dataset), world_size))
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))


def _share_sampler(records: list[Any], rank: int, world_size: int) -> Sampler[int] | None:
    return None if world_size == 1 else _StridedShare(records, rank, world_size)
