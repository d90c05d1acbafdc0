"""Text as users bring it: data modules, documents, tokenizers and the predictions file.

- :mod:`~bb_lightning.data.modules`: :class:`TextDataModule` (packed text for ``fit``) and
  :class:`PromptsDataModule` (prompt batches for ``predict``), with their settings checks;
- :mod:`~bb_lightning.data.documents`: reading and packing documents, reading prompts files;
- :mod:`~bb_lightning.data.tokenizer`: the tokenizer of a model directory, or bytes;
- :mod:`~bb_lightning.data.writer`: :class:`~bb_lightning.data.writer.JsonlPredictionWriter`,
  the resumable predictions file (also importable as ``bb_lightning.writer``).

Recipes name the data modules by this package (``bb_lightning.data.TextDataModule``).
"""

from __future__ import annotations

from bb_lightning.data.modules import (
    PromptsDataModule,
    SeededSampler,
    TextDataModule,
    pack_documents,
    prompt_digest,
    read_documents,
    resolve_files,
)

__all__ = [
    "PromptsDataModule",
    "SeededSampler",
    "TextDataModule",
    "pack_documents",
    "prompt_digest",
    "read_documents",
    "resolve_files",
]
