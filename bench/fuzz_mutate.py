"""Mutations of the files users bring, drawn with hypothesis (shared by ``bench/fuzz.py`` and
the CI slice ``tests/bench/test_fuzz.py``).

Each mutator takes hypothesis' ``data`` object and a file, draws what to change and
rewrites the file in place: JSON value swaps (types, huge and negative numbers, NaN,
nesting, unicode, missing and extra keys), byte flips, truncation, appended bytes, and
safetensors header tricks (a header length past the file, of zero, of 2**63; the header's
offsets, shapes and dtypes swapped). Nothing here knows the project's code.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2, -(2**31), 2**31, 2**63, -(2**63), 2**64 + 1, 10**30]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, -0.0, 1e308, 1e-320]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "float32", "bfloat16", "BF16", "F64", "group", "array", "c", "../x"]),
    st.text(max_size=12),
)
"""JSON values a field may be swapped for (a value of another type, or an extreme)."""

JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
"""Leaves, lists and small dicts of them."""


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) to a value inside ``doc``, the root excluded."""
    out: list[tuple[Any, ...]] = []
    items: list[tuple[Any, Any]] = []
    if isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


def mutate_json_doc(data: st.DataObject, doc: Any) -> Any:
    """``doc`` with one to three drawn changes (swap a value, drop a key, add a key, swap
    the whole document)."""
    for _ in range(data.draw(st.integers(1, 3), label="json changes")):
        paths = _paths(doc)
        kind = data.draw(
            st.sampled_from(["swap", "swap", "swap", "drop", "add", "root", "wrap"]), label="kind"
        )
        if kind == "root" or not paths:
            doc = data.draw(JSON_VALUES, label="root")
            continue
        path = data.draw(st.sampled_from(paths), label="path")
        parent = _parent(doc, path)
        if kind == "swap":
            parent[path[-1]] = data.draw(JSON_VALUES, label="value")
        elif kind == "wrap":
            parent[path[-1]] = [parent[path[-1]]]
        elif kind == "drop":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8), label="key")] = data.draw(JSON_VALUES)
        else:
            parent.append(data.draw(JSON_VALUES, label="item"))
    return doc


def mutate_json_file(data: st.DataObject, path: Path) -> None:
    """Rewrite the JSON file ``path`` with :func:`mutate_json_doc` (NaN and Infinity written
    as Python's json writes them)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):  # damaged by an earlier change: change its bytes
        mutate_bytes_file(data, path)
        return
    path.write_text(json.dumps(mutate_json_doc(data, doc)), encoding="utf-8")


def mutate_bytes_file(data: st.DataObject, path: Path) -> None:
    """Flip bytes, truncate, append, or replace the whole file."""
    raw = bytearray(path.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "append", "replace", "empty", "nest"]))
    if kind == "flip" and raw:
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] = data.draw(st.integers(0, 255), label="byte")
    elif kind == "truncate" and raw:
        del raw[data.draw(st.integers(0, len(raw) - 1), label="cut") :]
    elif kind == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    elif kind == "replace":
        raw = bytearray(data.draw(st.binary(max_size=256), label="bytes"))
    elif kind == "nest":  # JSON nested past any parser's recursion limit
        depth = data.draw(st.sampled_from([100, 5000, 100_000]), label="depth")
        raw = bytearray(b"[" * depth + b"]" * depth)
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))


def mutate_safetensors_file(data: st.DataObject, path: Path) -> None:
    """A safetensors file with its header length or its header's JSON changed (the header
    kept consistent with its length unless the length itself is the change), or its bytes."""
    raw = path.read_bytes()
    try:
        (length,) = struct.unpack("<Q", raw[:8])
        header, body = raw[8 : 8 + length], raw[8 + length :]
        doc = json.loads(header)
    except (struct.error, ValueError, RecursionError):  # damaged by an earlier change
        mutate_bytes_file(data, path)
        return
    kind = data.draw(st.sampled_from(["length", "header", "header", "bytes"]), label="st kind")
    if kind == "length":
        size = len(raw)
        new = data.draw(
            st.sampled_from(
                [0, 1, 2, size - 8, size - 7, size, 2**32, 2**63, 2**64 - 1, length - 1]
            )
            | st.integers(0, 2**64 - 1),
            label="length",
        )
        path.write_bytes(struct.pack("<Q", max(0, new)) + raw[8:])
        return
    if kind == "bytes":
        mutate_bytes_file(data, path)
        return
    keys = [k for k in doc if k != "__metadata__"] if isinstance(doc, dict) else []
    if keys and isinstance(doc[keys[0]], dict) and data.draw(st.booleans(), label="targeted"):
        entry = doc[data.draw(st.sampled_from(keys), label="tensor")]
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field")
        end = len(body)
        entry[field] = data.draw(
            st.one_of(
                JSON_VALUES,
                st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "BOOL", "F8_E4M3", "X"]),
                st.lists(st.integers(-2, 2**40), max_size=4),
                st.sampled_from([[0, end], [end, 0], [0, end + 1], [0, 2**63], [-1, 4]]),
            ),
            label="entry value",
        )
    else:
        doc = mutate_json_doc(data, doc)
    text = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
