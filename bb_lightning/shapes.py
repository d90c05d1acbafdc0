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

SWAP_MARGIN = 1.02
"""What the store holds beyond the traced saved activations of a swapped block
(``ModelProfile.swap_bytes_per_token``), on the host and in the device's slots. The trace
counts each saved view as the block stores it, so this covers only what it cannot see:
the arena's rounding of each tensor and saved tensors whose size is not linear in the
tokens (the traced count equals the packed bytes within 0.1 % for Llama, OPT, Qwen2 and
Mixtral shapes)."""


def cache_length(tokens: int) -> int:
    """Positions of the KV cache that holds sequences of ``tokens`` tokens (prompt and new):
    ``tokens`` rounded up to a multiple of :data:`CACHE_ROUND`, so that batches of ragged
    prompts share one cache. A decode pass attends over all of them (unwritten ones masked)."""
    return -(-tokens // CACHE_ROUND) * CACHE_ROUND
