"""Small pure cost functions of the profiles: FLOPs, seconds, bytes.

Each function states its formula and where it comes from. Times are seconds,
sizes bytes, bandwidths bytes/s, compute FLOP/s. Functions that take byte or
FLOP counts also accept numpy arrays, so the search can price many placements
at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from bb_lightning.placement import SCRATCH_FP32, SCRATCH_SETS, STATE_PIECE
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier

__all__ = [
    "ADAM_STATE_BYTES",
    "BF16_BYTES",
    "FP32_BYTES",
    "GIB",
    "LOSS_CHUNK_BYTES",
    "activation_bytes",
    "backward_peak_bytes",
    "budgets",
    "compute_seconds",
    "deferred_optimizer_exposed_seconds",
    "device_budget",
    "flops_utilisation",
    "forward_flops_per_token",
    "grad_bytes_in_flight",
    "head_grad_bytes",
    "hide_tokens_per_pass",
    "host_adam_seconds",
    "host_budget",
    "kv_cache_bytes",
    "link_seconds",
    "logits_bytes",
    "loss_chunk_tokens",
    "loss_tokens",
    "model_flops_per_token",
    "nvme_budget",
    "optimizer_exposed_seconds",
    "pass_exposed_seconds",
    "ring_seconds",
    "scratch_set_bytes",
    "setup_host_bytes",
    "shard_numel",
    "state_piece_numel",
    "state_pieces_per_block",
    "store_overhead_bytes",
    "train_flops_per_token",
]

Num = TypeVar("Num", float, npt.NDArray[np.float64])

BF16_BYTES = 2
"""Bytes per bf16 element (weights, activations, KV cache, gradients on the link)."""
FP32_BYTES = 4
"""Bytes per fp32 element (gradient accumulators, logits for the loss)."""
ADAM_STATE_BYTES = 12
"""fp32 master weight + AdamW first and second moments, bytes per parameter."""
GIB = 1024**3
"""Bytes in a GiB."""

DEVICE_MARGIN_FRACTION = 0.10
"""Share of device memory never planned (allocator fragmentation, kernels' workspaces)."""
DEVICE_MARGIN_BYTES = GIB
"""Bytes of device memory never planned on top of the fraction (CUDA context, cuBLAS)."""
HOST_MARGIN_FRACTION = 0.05
"""Share of host memory (and of NVMe capacity) never planned."""
MIN_BANDWIDTH = 1.0
"""A link with no bandwidth is priced at this many bytes/s (so it is never chosen)."""


# ---------------------------------------------------------------- budgets (bytes)
def device_budget(hw: HardwareProfile) -> int:
    """Plannable device bytes: ``device_memory - (10% of it + 1 GiB)``, at least 0."""
    margin = DEVICE_MARGIN_FRACTION * hw.device_memory + DEVICE_MARGIN_BYTES
    return max(0, int(hw.device_memory - margin))


def host_budget(hw: HardwareProfile) -> int:
    """Plannable host bytes: ``host_memory`` less 5%."""
    return int(hw.host_memory * (1.0 - HOST_MARGIN_FRACTION))


def nvme_budget(hw: HardwareProfile) -> int:
    """Plannable NVMe bytes: ``nvme_capacity`` less 5% (0 without an NVMe path)."""
    if hw.nvme_read_bandwidth <= 0 or hw.nvme_write_bandwidth <= 0:
        return 0
    return int(hw.nvme_capacity * (1.0 - HOST_MARGIN_FRACTION))


def pooled_budget(hw: HardwareProfile, budgets: Mapping[Tier, int]) -> int | None:
    """Bytes of RAM the device and host tiers share on a CPU device, None elsewhere.

    Without an accelerator both tiers are ordinary memory (the store's arenas are mapped
    lazily: pages count only once written), so a plan may spend the two budgets in any
    proportion: activations or a KV cache that outgrow the device budget take what the
    host leaves.
    """
    if hw.device_type != "cpu":
        return None
    return budgets[Tier.DEVICE] + budgets[Tier.HOST]


def budgets(hw: HardwareProfile) -> dict[Tier, int]:
    """Plannable bytes per tier: :func:`device_budget`, :func:`host_budget`, :func:`nvme_budget`."""
    return {Tier.DEVICE: device_budget(hw), Tier.HOST: host_budget(hw), Tier.NVME: nvme_budget(hw)}


# ---------------------------------------------------------------- FLOPs
def forward_flops_per_token(model: ModelProfile, context: float) -> float:
    """Forward FLOPs per token of the whole model attending over ``context`` tokens.

    ``num_blocks * (2 * block_active_matmul_params + 4 * num_heads * head_dim * context)``
    (the active weights: the top-k experts of an MoE block) plus the head's ``2 * hidden * vocab``
    (Kaplan et al. 2020, Table 1, which counts attention against the full context);
    the embedding is a lookup (no FLOPs).
    """
    block = (
        2.0 * model.block_active_matmul_params + 4.0 * model.num_heads * model.head_dim * context
    )
    return model.num_blocks * block + model.head_flops_per_token()


Arr = npt.NDArray[np.float64]


@overload
def train_flops_per_token(
    model: ModelProfile, seq_len: int, checkpointing: bool, resident_blocks: float = 0.0
) -> float: ...
@overload
def train_flops_per_token(
    model: ModelProfile, seq_len: int, checkpointing: bool, resident_blocks: Arr
) -> Arr: ...
def train_flops_per_token(
    model: ModelProfile, seq_len: int, checkpointing: bool, resident_blocks: float | Arr = 0.0
) -> float | Arr:
    """Training FLOPs per token: forward + backward (2x forward) + recompute.

    Backward costs twice the forward (Kaplan et al. 2020, C ~ 6N per token). With
    per-block activation checkpointing each block's forward runs again before its
    backward (Korthikanti et al. 2022, "Reducing Activation Recomputation"), so the
    blocks cost 4x forward, else 3x; ``resident_blocks`` (weights kept on the device,
    activations kept, never recomputed) cost 3x either way. The head is not
    checkpointed: 3x. ``resident_blocks`` may be an array (one value per candidate).

    Frozen weights (a LoRA base) need no weight gradient: the ``2`` FLOPs per frozen
    matrix weight per token of that product are dropped (each block's
    ``block_matmul_params - block_train``, the head's when nothing outside the blocks
    trains); their input gradients are still computed.
    """
    head = model.head_flops_per_token()
    per_block = (forward_flops_per_token(model, seq_len) - head) / max(model.num_blocks, 1)
    recomputed = model.num_blocks - resident_blocks if checkpointing else 0.0 * resident_blocks
    frozen = max(model.block_matmul_params - model.block_train, 0)
    skipped = model.num_blocks * 2.0 * frozen + (head if model.rest_train == 0 else 0.0)
    return per_block * (3.0 * model.num_blocks + recomputed) + 3.0 * head - skipped


@overload
def backward_fraction(checkpointing: bool, recomputed_share: float = 1.0) -> float: ...
@overload
def backward_fraction(checkpointing: bool, recomputed_share: Arr) -> Arr: ...
def backward_fraction(checkpointing: bool, recomputed_share: float | Arr = 1.0) -> float | Arr:
    """Share of a training pass's block FLOPs spent in recompute + backward.

    A block costs 1 forward + 2 backward, plus 1 recompute when it is checkpointed
    (see :func:`train_flops_per_token`); with a share ``f`` of the blocks recomputed
    that is ``(2 + f) / (3 + f)``: 3/4 when every block is, 2/3 without checkpointing.
    """
    f = recomputed_share if checkpointing else 0.0 * recomputed_share
    return (2.0 + f) / (3.0 + f)


def model_flops_per_token(model: ModelProfile, task: str, seq_len: int) -> float:
    """Model FLOPs per token, the numerator of MFU: ``6 N + 12 L H Q T`` training,
    ``2 N + 4 L H Q T`` generation (Chowdhery et al. 2022, PaLM, Appendix B), with ``N``
    the matrix-product parameters a token uses (the top-k experts of an MoE block, and
    the head), ``L H Q`` blocks x query heads x head size and ``T`` the sequence length in
    tokens (a training sequence; prompt plus new tokens when generating). Recomputation
    is not counted. One forward is :func:`forward_flops_per_token`.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1 (tokens)")
    return (3.0 if task == "fit" else 1.0) * forward_flops_per_token(model, seq_len)


def flops_utilisation(model_flops: float, hw: HardwareProfile) -> tuple[float, float]:
    """``(MFU, share of the priced rate)`` of ``model_flops`` model FLOP/s on one device:
    over the datasheet peak (``hw.peak_flops``; 0.0 where none is known) and over the
    rate plans are priced at (``hw.device_flops``: measured, or the preset's derated
    datasheet figure)."""
    mfu = model_flops / hw.peak_flops if hw.peak_flops > 0 else 0.0
    return mfu, model_flops / max(hw.device_flops, MIN_BANDWIDTH)


# ---------------------------------------------------------------- seconds
def link_seconds(nbytes: Num, bandwidth: float, efficiency: float = 1.0) -> Num:
    """Seconds to move ``nbytes`` over a link: ``bytes / (bandwidth * efficiency)``."""
    return nbytes / max(bandwidth * efficiency, MIN_BANDWIDTH)


def compute_seconds(flops: Num, hw: HardwareProfile) -> Num:
    """Seconds of device compute: ``FLOPs / (device_flops * compute_efficiency)``."""
    return flops / max(hw.device_flops * hw.compute_efficiency, MIN_BANDWIDTH)


def host_grad_bytes_per_param(grad_accum: Num, compute_bytes: float, held: bool = False) -> Num:
    """Bytes of host memory the gradient worker moves per trained parameter and optimizer
    step, besides the AdamW update itself.

    The first micro-batch's gradient (``compute_bytes`` per element) is read and its fp32
    copy written (``compute_bytes + 4``); every later one is read and added to the fp32
    sum, which is read and written again (``compute_bytes + 8``); after the update the
    fp32 master is read and cast back to the compute dtype (``4 + compute_bytes``). With
    bf16 and 4 micro-batches that is 6 + 3 x 10 + 6 = 42 bytes. With ``held`` gradients
    (``Placement.hold_grads``) every micro-batch's gradient is read once and the fp32 sum
    written once: ``grad_accum * compute_bytes + 4``, then the cast: 8 + 4 + 6 = 18 bytes.
    """
    if held:
        return grad_accum * compute_bytes + 4 + (4 + compute_bytes)
    return (compute_bytes + 4) + (grad_accum - 1) * (compute_bytes + 8) + (4 + compute_bytes)


def held_grad_bytes(grad_accum: int, compute_bytes: int, trained_params: float) -> float:
    """Bytes of memory that held gradients take at most (``Placement.hold_grads``): every
    micro-batch's but the last, ``compute_bytes`` per trained parameter each."""
    return float(max(grad_accum - 1, 0) * compute_bytes) * trained_params


def host_adam_seconds(params: Num, hw: HardwareProfile) -> Num:
    """Seconds of host AdamW: ``params / (host_adam_params_per_s * optimizer_efficiency)``."""
    return params / max(hw.host_adam_params_per_s * hw.optimizer_efficiency, MIN_BANDWIDTH)


def pass_exposed_seconds(
    compute_s: Num, links: Mapping[Link, Num], net: Num | float | None = None
) -> Num:
    """Seconds of one pass not hidden behind its compute.

    Overlap model: the links (NVMe read, NVMe write, H2D, D2H) run concurrently with
    compute and with each other, so a pass takes ``max(compute, each link's time)``
    and ``max(...) - compute`` is exposed. Bytes from NVMe to the device cross two
    links (NVMe read, then H2D): both carry them, each priced on its own. ``net``, the
    seconds of the pass's collectives between data-parallel ranks on the devices (their
    own stream; :func:`~bb_lightning.planner.data_parallel.collective_seconds`), is one
    more such link (None: one rank, no collectives).
    """
    longest = compute_s
    for seconds in links.values():
        longest = np.maximum(longest, seconds)
    if net is not None:
        longest = np.maximum(longest, net)
    return longest - compute_s


def ring_seconds(nbytes: Num, world_size: int, bandwidth: float, latency: float) -> Num:
    """Seconds of one ring reduce-scatter or all-gather of a buffer of ``nbytes`` (the
    whole buffer, all ranks' shards) over ``world_size`` ranks.

    ``(N - 1) / N * bytes / bandwidth + (N - 1) * latency``: in each of the ring's
    ``N - 1`` steps every rank sends one shard (``bytes / N``) to its neighbour and waits
    ``latency`` seconds besides (Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations"; an all-reduce is both, twice this). The
    ``bandwidth`` is that of the slowest hop (bytes/s); 0 seconds for one rank.
    """
    n = world_size
    if n <= 1:
        return 0.0 * nbytes
    return (n - 1) / n * nbytes / max(bandwidth, MIN_BANDWIDTH) + (n - 1) * latency


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard of ``numel`` elements: ``ceil(numel / N)`` (the
    last rank's shard padded to the others' size; the engine's dim-0 shard pads each
    parameter's rows, a few rows more per block)."""
    return -(-numel // max(world_size, 1))


def optimizer_exposed_seconds(optimizer_s: Num, backward_s: Num, units: Num, clipping: bool) -> Num:
    """Seconds of the optimizer step not hidden behind the last backward.

    Each block's host AdamW starts as soon as its gradients are final, while backward
    still works on earlier blocks, so only ``max(0, optimizer - backward)`` plus the
    last unit's share ``optimizer / units`` is exposed. A step that waits for every
    gradient and runs after backward (``clipping``: by value, or under data parallelism)
    is wholly exposed; a norm-clipped step of one rank is priced by
    :func:`deferred_optimizer_exposed_seconds`.
    """
    if clipping:
        return optimizer_s
    return np.maximum(0.0, optimizer_s - backward_s) + optimizer_s / np.maximum(units, 1.0)


def deferred_optimizer_exposed_seconds(
    resident_s: Num, blocks_s: Num, forward_s: Num, blocks: Num
) -> Num:
    """Seconds of a norm-clipped optimizer step not hidden behind the next forward.

    The clip scale is known when backward ends (each block's gradient norm is taken as
    its gradient is summed). Then the parameters outside the blocks step on the main
    thread (``resident_s``, exposed) and the ``blocks`` blocks step one after another on
    the host worker, block 0 first (``blocks_s`` in all, ``u = blocks_s / blocks`` each),
    while the next forward (``forward_s``, ``f = forward_s / blocks`` per block) uses
    block ``i`` once its update is done. Block ``i``'s update ends at ``(i + 1) u``, so
    the forward ends at ``max_i((i + 1) u + (blocks - i) f) = max(u + forward_s,
    blocks_s + f)``: ``max(u, blocks_s - forward_s + f)`` beyond its own compute, block
    0's update at least, and all the updates but the forward's last block's share when
    they outlast it.
    """
    n = np.maximum(blocks, 1.0)
    return resident_s + np.maximum(blocks_s / n, blocks_s - forward_s + forward_s / n)


def hide_tokens_per_pass(
    flops_per_token_per_param: float, bytes_per_param: float, device_flops: float, link: float
) -> float:
    """Tokens per pass at which a weight pass hides behind compute.

    ``(device FLOP/s / link bytes/s) * (bytes per param / FLOPs per param per token)``.
    """
    return device_flops / max(link, MIN_BANDWIDTH) * bytes_per_param / flops_per_token_per_param


# ---------------------------------------------------------------- bytes
@overload
def activation_bytes(
    model: ModelProfile,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    resident_blocks: int = 0,
) -> int: ...
@overload
def activation_bytes(
    model: ModelProfile, micro_batch: int, seq_len: int, checkpointing: bool, resident_blocks: Arr
) -> Arr: ...
def activation_bytes(
    model: ModelProfile,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    resident_blocks: int | Arr = 0,
) -> int | Arr:
    """Device bytes of training activations for one micro-batch.

    Checkpointing keeps each block's input (``act_bytes_per_token_checkpointed`` per
    token per block) plus one block's full activations while it is recomputed;
    ``resident_blocks`` (never recomputed) and, without checkpointing, every block
    keep their full activations. ``resident_blocks`` may be an array.
    """
    tokens = micro_batch * seq_len
    full, ckpt = model.act_bytes_per_token_full, model.act_bytes_per_token_checkpointed
    if checkpointing:
        per_token = ckpt * (model.num_blocks - resident_blocks) + full * resident_blocks + full
    else:
        per_token = full * model.num_blocks + 0 * resident_blocks
    return tokens * per_token


LOSS_FP32_BUFFERS = 3
"""fp32 buffers of the logits' size the training loss holds at once (:func:`logits_bytes`)."""


LOSS_CHUNK_BYTES = 1 << 30
"""Device bytes one chunk of a chunked loss may hold at its peak when its size is chosen
from the vocabulary (:func:`loss_chunk_tokens`): 1 GiB."""


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of a chunked loss (``CausalLMModule``'s default) whose peak,
    :func:`logits_bytes` of the chunk (``12 * vocab`` bytes per token), stays within
    :data:`LOSS_CHUNK_BYTES`: 697 at a 128,256-token vocabulary, 2,796 at 32,000; >= 1."""
    return max(1, LOSS_CHUNK_BYTES // (max(1, vocab_size) * FP32_BYTES * LOSS_FP32_BUFFERS))


def loss_tokens(tokens: Any, chunk: int | None) -> Any:
    """Tokens whose logits the loss holds at once: the pass's ``tokens`` (an array or a
    number), or at most ``chunk`` of them when the loss runs in chunks (None: whole)."""
    return tokens if chunk is None else np.minimum(tokens, chunk)


def logits_bytes(model: ModelProfile, tokens: int) -> int:
    """Device bytes the training loss holds at its peak: ``tokens * vocab * 12``.

    transformers' causal-LM loss (``ForCausalLMLoss``) upcasts the logits to fp32 and
    takes ``cross_entropy``, which saves its ``_log_softmax`` output (4 bytes per token
    per vocabulary entry); in backward ``nll_loss_backward`` writes the gradient of that
    output (4) and ``_log_softmax_backward_data`` the gradient of its input (4) while
    both are still held: three fp32 buffers of the logits' size, the device peak a dry
    run of a 128k vocabulary names (:mod:`bb_lightning.strategy.dryrun`).
    """
    return tokens * model.vocab_size * FP32_BYTES * LOSS_FP32_BUFFERS


HEAD_GRAD_COPIES = 3
"""Output-head weight gradients a chunked loss's backward holds at once: the sum of the
chunks' so far, the next chunk's and their sum (autograd sums a parameter's gradients
out of place while a backward runs)."""
HIDDEN_GRAD_COPIES = 3
"""Gradients of the pass's hidden states (``tokens x hidden``) a chunked loss's backward
holds at once: a chunk's gradient reaches the hidden states through the slice it read,
as a zero-padded gradient of the whole, summed out of place as the head's are."""


def head_grad_bytes(model: ModelProfile, elem_bytes: int) -> int:
    """Device bytes of the output head's weight gradient, ``vocab * hidden * elem_bytes``
    (0 when nothing outside the blocks is trained): computed in the loss's backward and
    held on the device until the backward ends."""
    return model.vocab_size * model.hidden_size * elem_bytes if model.rest_train > 0 else 0


def backward_peak_bytes(
    model: ModelProfile,
    tokens: Any,
    checkpointing: bool,
    chunk: int | None,
    elem_bytes: int,
) -> Any:
    """Device bytes of a training pass's backward beyond the activations the forward keeps
    (:func:`activation_bytes` less the recomputed block's): the larger of two phases.

    - The loss's backward. Whole: :func:`logits_bytes` of the pass and the head's weight
      gradient. In chunks of ``chunk`` tokens: one chunk's logits buffers or the head's
      gradients being summed (:data:`HEAD_GRAD_COPIES` less the running sum), the running
      sum, :data:`HIDDEN_GRAD_COPIES` gradients of the hidden states, and the final norm's
      fp32 copy of them (``4 * hidden`` bytes per token: Llama-style RMS norms compute in
      fp32 and keep that input for their backward; the whole loss's logits outweigh it).
    - A block's backward: its saved activations when recomputed
      (``act_bytes_per_token_full`` per token, checkpointing only), what its backward
      holds beyond them (``act_bytes_per_token_backward``, introspected on ``meta``), and
      the head's gradient, held throughout.
    - The final norm's backward, over the whole pass (:data:`NORM_BACKWARD_BYTES`), and
      the head's gradient.

    ``tokens`` (the pass's) may be an array; ``elem_bytes`` is the compute dtype's size.
    """
    head = head_grad_bytes(model, elem_bytes)
    if chunk is None:
        loss = logits_bytes(model, tokens) + head
    else:
        hidden = tokens * model.hidden_size * (HIDDEN_GRAD_COPIES * elem_bytes + FP32_BYTES)
        summing = (HEAD_GRAD_COPIES - 1) * head
        loss = np.maximum(logits_bytes(model, np.minimum(tokens, chunk)), summing) + head + hidden
    recompute = model.act_bytes_per_token_full if checkpointing else 0
    block = tokens * (recompute + model.act_bytes_per_token_backward) + head
    norm = tokens * model.hidden_size * NORM_BACKWARD_BYTES + head
    return np.maximum(np.maximum(loss, block), norm)


NORM_BACKWARD_BYTES = 24
"""Bytes per token and hidden element the final norm's backward holds at its peak, over the
whole pass: a Llama-style RMS norm computes in fp32 and its backward keeps its fp32 input,
the gradients through its square, scale and product, and the hidden states' gradient at
once (about six fp32 buffers of the hidden states; what dry runs of passes of 65,536 to
262,144 tokens name as the device's peak when a chunked loss no longer is)."""


def setup_host_bytes(
    rest_train: float,
    block_params: float,
    block_train: float,
    elem_bytes: int,
    shard: float | None = None,
) -> float:
    """Host bytes outside the store while the training engine registers its state:
    ``max(4 * rest_train, 4 * (block_params + split) + stored)``, where ``split`` is
    ``block_params`` when the block has frozen parameters, else 0, and ``stored`` is
    ``elem_bytes * block_params``, or with data parallelism ``(4 + elem_bytes) * shard``
    (the rank's fp32 shard of the weights, ``shard`` elements, taken apart, then cast).

    First the fp32 initial values of the trained parameters outside the blocks
    (``rest_train`` elements, read whole), dropped once they are stored and bound to the
    device; then, one block at a time, the fp32 values of all of the largest block's
    parameters (``block_params``; ``block_train`` of them trained), their trained and
    frozen parts copied apart when it has frozen ones, and the compute-dtype copy each
    part is stored from (``TrainingEngine._store_states``, ``BlockPager``). The moments
    are made as zeros by the store itself (``FlatState``).
    """
    split = block_params if block_train < block_params else 0.0
    stored = elem_bytes * block_params if shard is None else (FP32_BYTES + elem_bytes) * shard
    block = FP32_BYTES * (block_params + split) + stored
    return float(max(FP32_BYTES * rest_train, block))


STORE_SLACK_BYTES = 1 << 20
"""Bytes the store's arenas are opened with beyond what their tensors need (a tier's
``need + 1 MiB``, :func:`bb_lightning.strategy.assembly.store_config`)."""
SLOT_ALIGNMENT = 4096
"""Bytes each tensor's slot in an arena is padded to (``storage.device.ALIGNMENT``)."""


def store_overhead_bytes(blocks: int) -> int:
    """Host bytes the training engine's store arena takes beyond its tensors' bytes, at
    most: :data:`STORE_SLACK_BYTES` plus one :data:`SLOT_ALIGNMENT` per tensor it may
    register, ``9 * blocks + 32`` (a block's weights, frozen weights, three state
    tensors, gradient and up to one read-ahead set of three per block; the scratch sets
    and the state outside the blocks).
    """
    return STORE_SLACK_BYTES + SLOT_ALIGNMENT * (9 * blocks + 32)


def state_piece_numel(block_state: float, piece: int = STATE_PIECE) -> float:
    """Elements of one piece of a block's flat state as the host AdamW step reads, steps and
    writes it (:attr:`bb_lightning.placement.Placement.state_piece`): ``min(block_state,
    piece)``, the size of each scratch and read-ahead buffer."""
    return float(min(block_state, piece))


def state_pieces_per_block(block_state: float, piece: int = STATE_PIECE) -> float:
    """Pieces the host AdamW step works through one block's flat state in:
    ``ceil(block_state / piece)`` (one for an empty state)."""
    return float(max(1, math.ceil(block_state / piece)))


def scratch_set_bytes(block_state: float, block_train: float, elem_bytes: int) -> float:
    """Host bytes of the optimizer's scratch sets the training engine registers:
    ``SCRATCH_SETS * (4 * 4 * piece + elem_bytes * piece)`` with ``piece`` the
    :func:`state_piece_numel` of the largest block's stored state (``block_state``
    elements; its trained weights ``block_train`` are laid out as the state): four fp32
    buffers and one compute-dtype ``cast`` of one piece each
    (:func:`bb_lightning.placement.training_manifest`).
    """
    fp32 = len(SCRATCH_FP32) * FP32_BYTES * state_piece_numel(block_state)
    return float(SCRATCH_SETS * (fp32 + elem_bytes * state_piece_numel(block_train)))


def kv_cache_bytes(model: ModelProfile, seqs: int, tokens_per_seq: int) -> int:
    """Bytes of the bf16 KV cache of all blocks: ``seqs * tokens * kv_bytes * num_blocks``."""
    return seqs * tokens_per_seq * model.kv_bytes_per_token * model.num_blocks


def offloaded_kv_bytes(model: ModelProfile, seqs: int, cache_len: int) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes one pass moves for a KV cache homed on the
    host beside the device's attention (:mod:`bb_lightning.engine.kv_paged`).

    Each layer's keys and values (``seqs x cache_len`` positions) are one store tensor on
    the host, paged to the device whole ahead of the layer's update and written back whole
    after it, as transformers' offloading cache moves them (``cache_utils.py``
    ``prefetch`` / ``offload``). A pass, the prefill too (its page-ins carry the positions
    it does not write, masked), so moves the whole cache each way.
    """
    whole = float(kv_cache_bytes(model, seqs, cache_len))
    return whole, whole


def grad_bytes_in_flight(model: ModelProfile, elem_bytes: int = BF16_BYTES) -> int:
    """Device bytes of compute-dtype gradients (``elem_bytes`` each) of paged blocks in
    flight: one computed, one copied (of the trained parameters only)."""
    return 2 * model.block_train * elem_bytes


def effective_bandwidths(hw: HardwareProfile) -> dict[Link, float]:
    """Bytes/s of each copy link after the profile's efficiency factors."""
    return {
        Link.HOST_TO_DEVICE: hw.h2d_bandwidth * hw.h2d_efficiency,
        Link.NVME_TO_HOST: hw.nvme_read_bandwidth * hw.nvme_efficiency,
        Link.DEVICE_TO_HOST: hw.d2h_bandwidth * hw.d2h_efficiency,
    }


def limited_by(exposed_pass_s: float, compute_s: float, batch_reached: bool) -> str:
    """Why tokens per pass stopped rising: transfers ``hidden``, the job's ``batch``, or ``memory``."""
    if exposed_pass_s <= 1e-12 * max(compute_s, 1e-30):
        return "hidden"
    return "batch" if batch_reached else "memory"
