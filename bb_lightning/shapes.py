"""Shape conventions the planner prices and the engine executes (imports nothing of ours).

Both sides must agree on them, and neither may import the other (see
``docs/architecture.md``, "Layers"), so they live in this leaf module.
"""

from __future__ import annotations

__all__ = ["CACHE_ROUND", "SWAP_CHUNKS_IN_FLIGHT", "SWAP_MARGIN", "cache_length"]

CACHE_ROUND = 32
"""KV cache lengths are multiples of this many tokens. A decode pass reads the whole
cache, so a coarser rounding costs memory traffic: 128 sequences of 128 + 32 tokens in a
192-position cache (rounded to 64) read a fifth more keys and values per pass than in
their 160 positions."""

SWAP_CHUNKS_IN_FLIGHT = 3
"""Chunks of saved activations a swapped block's backward holds on the device at once
(``Placement.swapped``): the chunk computing, the next one being fetched, and the one the
next block reads first. The store reserves device slots for them all the step."""

SWAP_MARGIN = 1.25
"""What the store holds beyond the estimated saved activations of a swapped block, on the
host and in the device's slots: autograd saves some of a block's tensors in several views
(a Llama-7B layer at 2,048 tokens in bf16 saved 6 % more than the planner's introspected
bytes per token in a dry run)."""


def cache_length(tokens: int) -> int:
    """Positions of the KV cache that holds sequences of ``tokens`` tokens (prompt and new):
    ``tokens`` rounded up to a multiple of :data:`CACHE_ROUND`, so that batches of ragged
    prompts share one cache. A decode pass attends over all of them (unwritten ones masked)."""
    return -(-tokens // CACHE_ROUND) * CACHE_ROUND
