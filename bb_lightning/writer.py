"""The predictions file's writer at the path recipes name
(``bb_lightning.writer.JsonlPredictionWriter``); it lives in :mod:`bb_lightning.data.writer`."""

from __future__ import annotations

from bb_lightning.data.writer import (
    JsonlPredictionWriter,
    find_shards,
    merge_shards,
    read_jsonl,
    recover_jsonl,
    shard_path,
)

__all__ = [
    "JsonlPredictionWriter",
    "find_shards",
    "merge_shards",
    "read_jsonl",
    "recover_jsonl",
    "shard_path",
]
