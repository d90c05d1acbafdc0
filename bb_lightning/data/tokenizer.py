"""Tokenizers: a built-in byte-level one that needs no download, and Hugging Face ones.

The data modules and :class:`~bb_lightning.module.CausalLMModule` accept either
kind through the helpers :func:`encode_text`, :func:`decode_ids`,
:func:`eos_id` and :func:`pad_id`, so that nothing else needs to know which
kind it holds.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ByteTokenizer",
    "Tokenizer",
    "decode_ids",
    "encode_text",
    "eos_id",
    "load_tokenizer",
    "pad_id",
]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then three specials: pad 256, bos 257, eos 258.

    ``encode`` adds no special tokens; ``decode`` drops them and replaces
    invalid UTF-8 and unknown ids with U+FFFD.
    """

    name = "byte"
    """Name under which :func:`load_tokenizer` returns this tokenizer."""
    pad_token_id = 256
    """Padding token (left padding in prompt batches)."""
    bos_token_id = 257
    """Beginning-of-sequence token."""
    eos_token_id = 258
    """End-of-sequence token, also the separator between packed documents."""
    vocab_size = 259
    """Number of token ids (tokens)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of the UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``: specials are dropped; bad UTF-8 and ids outside the
        vocabulary (a model whose vocabulary is padded may emit them) become U+FFFD."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if not 256 <= i < self.vocab_size:
                out.append(run.decode("utf-8", errors="replace") + "\ufffd")
                run.clear()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


Tokenizer = Any
"""A :class:`ByteTokenizer` or a ``transformers.PreTrainedTokenizerBase``."""


def load_tokenizer(name_or_path: str | None) -> Tokenizer:
    """The tokenizer called ``name_or_path``.

    ``None`` or ``"byte"`` gives :class:`ByteTokenizer`; anything else is passed
    to ``transformers.AutoTokenizer.from_pretrained`` (a local directory, or a
    hub id, which needs the network the first time).
    """
    if name_or_path is None or name_or_path == ByteTokenizer.name:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def encode_text(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens`` lets a HF tokenizer add bos etc."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return [int(i) for i in ids]


def decode_ids(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` without special tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def eos_id(tokenizer: Tokenizer) -> int:
    """The end-of-sequence id; ValueError if the tokenizer has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            f"tokenizer {tokenizer!r} has no eos_token_id: packing needs a document separator; "
            "pick a tokenizer with an eos token or use tokenizer='byte'"
        )
    return int(eos)


def pad_id(tokenizer: Tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else its eos token."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else eos_id(tokenizer)
