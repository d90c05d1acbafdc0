"""Reading the data modules' files: text documents (``.txt``, ``.jsonl`` rows' ``"text"``)
packed into rows of token ids (:func:`pack_documents`), and prompts files (``.jsonl`` of
``{"id", "prompt"}`` rows, :func:`prompt_rows`). The layouts are described in
:mod:`bb_lightning.data`."""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bb_lightning.data.tokenizer import ByteTokenizer, Tokenizer, encode_text, eos_id

__all__ = [
    "pack_documents",
    "prompt_digest",
    "prompt_rows",
    "read_documents",
    "resolve_files",
    "row_ids",
]


def resolve_files(paths: str | list[str], max_files: int | None = None) -> list[Path]:
    """Files matched by the glob patterns (``**`` recurses), sorted per pattern, deduplicated.

    Raises ValueError naming a pattern that matches no file.
    """
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise ValueError("paths is empty: pass at least one glob such as 'data/*.txt'")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files={max_files} must be >= 1 (or None for all files)")
    files: list[Path] = []
    seen: set[str] = set()
    for pattern in patterns:
        matched = sorted(
            p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
        )
        if not matched:
            raise ValueError(f"pattern {pattern!r} matches no file: check the path and the glob")
        for p in matched:
            key = os.path.realpath(p)
            if key not in seen:
                seen.add(key)
                files.append(Path(p))
    return files[:max_files] if max_files is not None else files


def read_documents(path: Path) -> Iterator[str]:
    """Documents of one file: the whole text of a ``.txt``, each row's ``"text"`` of a ``.jsonl``.

    Raises ValueError naming ``file:line`` for a row that is not JSON or has no string ``"text"``.
    """
    if path.suffix != ".jsonl":
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json_row(path, lineno, line)
            text = row.get("text")
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: row has no string field 'text' (keys: {sorted(row)}); "
                    'each .jsonl row must look like {"text": "..."}'
                )
            yield text


def json_row(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line"
        ) from e
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits, deep nesting
        why = str(e).partition("\n")[0] or type(e).__name__
        raise ValueError(
            f"{path}:{lineno}: JSON this program cannot read ({why}); fix or remove the line"
        ) from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
    return row


def prompt_rows(path: Path) -> dict[int, tuple[str | None, str]]:
    """``{line number: (given id or None, prompt)}`` of a prompts file, in file order."""
    rows: dict[int, tuple[str | None, str]] = {}
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            row = json_row(path, lineno, line)
            prompt = row.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError(
                    f"{path}:{lineno}: row has no string field 'prompt'; "
                    'each row must look like {"id": "...", "prompt": "..."}'
                )
            rid = row.get("id")
            if rid is not None and (isinstance(rid, bool) or not isinstance(rid, str | int)):
                raise ValueError(
                    f"{path}:{lineno}: id {json.dumps(rid)[:60]} is a JSON "
                    f"{json_type(rid)}; an id must be a string or an integer (or left out)"
                )
            for field, text in (("id", rid), ("prompt", prompt)):
                if isinstance(text, str) and not encodable(text):
                    raise ValueError(
                        f"{path}:{lineno}: the {field} holds a lone UTF-16 surrogate (an "
                        "escape such as \\ud800 without its pair), which is not text: fix the "
                        "escape or remove the line"
                    )
            rows[lineno] = (None if rid is None else str(rid), prompt)
    return rows


def encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode text (JSON escapes can make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: Any) -> str:
    names = {bool: "boolean", float: "number", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def prompt_digest(prompt: str) -> str:
    """The first 16 hex digits of the SHA-256 of ``prompt``'s UTF-8 bytes: what a
    predictions file records of the prompt each line was generated for."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def row_ids(path: Path, rows: dict[int, tuple[str | None, str]]) -> list[str]:
    """The id of each row: its own, else one made from its line number that no row gives.

    A row without an id gets ``"<line>"`` (its 1-based line number), or ``"line-<line>"``
    where another row gives that id (``"line-<line>-2"``, ``-3``, ... where that is
    given too). Raises ValueError naming both lines of an id given twice.
    """
    given: dict[str, int] = {}
    for lineno, (rid, _) in rows.items():
        if rid is None:
            continue
        first = given.setdefault(rid, lineno)
        if first != lineno:
            raise ValueError(
                f"{path}:{lineno}: id {rid!r} is also the id of line {first}; ids must be "
                "unique (the predictions are keyed by id): give one of the rows another id"
            )
    ids: list[str] = []
    for lineno, (rid, _) in rows.items():
        if rid is None:
            made = (f"line-{lineno}-{k}" for k in itertools.count(2))
            rid = next(c for c in itertools.chain([str(lineno), f"line-{lineno}"], made)
                       if c not in given)  # fmt: skip
        ids.append(rid)
    return ids


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(encode_text(tokenizer, text), dtype=np.int32)


def pack_documents(
    files: list[Path], tokenizer: Tokenizer, seq_len: int, max_tokens: int | None = None
) -> Tensor:
    """Tokenise the documents of ``files`` in order, each followed by eos, into rows.

    Returns an int32 tensor ``[rows, seq_len]`` (tokens); the stream is cut
    at ``max_tokens`` first, and a tail shorter than ``seq_len`` is dropped.
    Raises ValueError when the text gives fewer than ``seq_len`` tokens.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1 (tokens per row)")
    if max_tokens is not None and max_tokens < seq_len:
        raise ValueError(
            f"max_tokens={max_tokens} < seq_len={seq_len}: no row fits; raise max_tokens"
        )
    eos = np.asarray([eos_id(tokenizer)], dtype=np.int32)
    chunks: list[np.ndarray] = []
    total = 0
    for path in files:
        for text in read_documents(path):
            if not encodable(text):
                raise ValueError(
                    f"{path}: a document holds a lone UTF-16 surrogate (an escape such as "
                    "\\ud800 without its pair), which is not text: fix the escape"
                )
            chunks += [encode_document(tokenizer, text), eos]
            total += len(chunks[-2]) + 1
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(
            f"{len(stream)} tokens from {len(files)} file(s) < seq_len={seq_len}: "
            "add text or lower seq_len"
        )
    return torch.from_numpy(stream[: rows * seq_len].reshape(rows, seq_len).copy())
