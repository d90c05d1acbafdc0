"""Shape conventions the planner prices and the engine executes (imports nothing of ours).

Both sides must agree on them, and neither may import the other (see
``docs/architecture.md``, "Layers"), so they live in this leaf module.
"""

from __future__ import annotations

__all__ = ["CACHE_ROUND", "cache_length"]

CACHE_ROUND = 32
"""KV cache lengths are multiples of this many tokens. A decode pass reads the whole
cache, so a coarser rounding costs memory traffic: 128 sequences of 128 + 32 tokens in a
192-position cache (rounded to 64) read a fifth more keys and values per pass than in
their 160 positions."""


def cache_length(tokens: int) -> int:
    """Positions of the KV cache that holds sequences of ``tokens`` tokens (prompt and new):
    ``tokens`` rounded up to a multiple of :data:`CACHE_ROUND`, so that batches of ragged
    prompts share one cache. A decode pass attends over all of them (unwritten ones masked)."""
    return -(-tokens // CACHE_ROUND) * CACHE_ROUND
