"""A decode-step attention for Hugging Face models: one query token over a static KV cache.

During a decode step every sequence brings one query token and attends to its
whole KV cache. PyTorch's fused CPU attention kernel
(``scaled_dot_product_attention``) is tiled for long query blocks; with a
single query row and a padding mask it spends most of a decode step's
attention time on per-tile overhead (several times the time of two batched matrix
products and a softmax). :func:`decode_attention` computes the same attention as two
batched products, the scores and then ``softmax·V``, with the softmax in fp32, grouping
query heads over their key/value head (GQA: the heads of a group are rows of one product,
so the cache is read once); every other call (prefill, training, softcapping, attention
sinks, position bias, dropout) goes to transformers' ``sdpa`` function unchanged, but for a
bf16 prefill on a CPU with matrix tiles or AVX-512's bf16 pair products, which runs there
where it computes what ``sdpa`` would (:func:`_prefill_on_tiles`).

The step reads every cached key and value once against a few FLOPs each, in products
one row per query head of a group: on a host of few cores the products' arithmetic, not
the memory, bounds it. Where it builds (a C compiler on the machine; fp32 and bf16 caches
whose rows are contiguous), a compiled kernel (:mod:`~bb_lightning.engine.native`) runs
each chunk: it reads the keys and values in place, once, with the host's own vector
instructions (bf16 pair products on CPUs that have them). Elsewhere torch's products run
it, each where it reads the cache fastest. fp32 scores
are BLAS's ``K·qᵀ`` with the keys as the left operand in their own layout. In bf16 (and
fp16) oneDNN's ``q·Kᵀ`` is the faster one over keys in the core's caches but stalls on keys
it reads from memory, so a chunk's keys are first read by a streaming sum that brings them
into the caches; and a cache cut after its written positions (:func:`attended_prefix`)
is not contiguous, which oneDNN's batched product answers by cloning it into fresh memory
at every step: such keys and values are copied into a buffer each thread keeps instead.

A large batch runs in chunks (about :data:`CHUNK_BYTES` of cache each: whole sequences,
or key/value heads of one sequence when a sequence exceeds it or the batch has fewer
sequences than workers) on a pool of as many threads as the caller's intra-op team, each
chunk on one thread. The products are skinny, so one op's team spends much of its time
waiting at the op's end for its slowest thread, once per op of the step; chunks on
single-threaded workers run their ops back to back, take the next chunk when done, and
keep a chunk's keys and scores in the core's caches. Each chunk computes what the whole
batch would, sequence by sequence. Where the compiled kernel shares torch's OpenMP runtime
and the model runs on the CPU, one call runs the whole step on the calling thread's OpenMP
team instead, torch's own intra-op threads: a pool's workers beside them would compete
for the cores with the team's threads, which keep spinning for a while after each
operation in wait for the next.

:func:`decode_attention_for` installs it for the duration of a ``with`` block,
only when the model runs transformers' ``sdpa`` implementation (an ``eager`` or
flash model is left as it is) on the CPU (on CUDA, ``sdpa``'s own kernels serve a
decode step), under the name ``sdpa`` itself, so the model runs exactly the code it
runs for ``sdpa``; afterwards ``sdpa`` is transformers' own again, so training and a
user's own calls see the model as loaded.

Beside another device (``decode_attention_for(model, host=True)``, the plan's decode
attention on the host with the KV cache there: :class:`~bb_lightning.engine.kv.KVCache`'s
``host_attention``) the same function serves the model on any device: a decode step's
query rows (and its mask) go to the host where the cache lives, the attention above runs
there on the host's cores, and its output returns to the model's device; a prefill's
attended cache prefix goes to the device and ``sdpa`` runs there. With groups of sequences
in flight (:mod:`~bb_lightning.engine.groups`) one group's attention runs on the host at a
time while the device computes for the others.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning.engine import host_linear
from bb_lightning.engine.groups import host_turn
from bb_lightning.engine.host_norm import eager
from bb_lightning.engine.native import NativeAttention, kernel
from storage.threads import single_threaded

__all__ = ["CHUNK_BYTES", "attended_prefix", "decode_attention", "decode_attention_for"]
__all__ += ["host_attention", "one_forward", "uses_sdpa"]

_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")

CHUNK_BYTES = 8 << 20
"""Bytes of keys and values one chunk of a decode step reads (at least one key/value head
of one sequence): large enough that a chunk's few ops outweigh their dispatch, small enough
that its keys stay in the CPU's caches between their first read and the product, and
that a batch makes several chunks per thread to balance."""

_pool_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None
"""(process id, workers, pool): a forked child holds its parent's pool without its threads."""

_scratch = threading.local()
"""Each thread's buffer a chunk's keys or values are made dense in (see :func:`_dense`)."""

_memo = threading.local()
"""The masks of this thread's current forward and what its layers derived from them
(see :func:`one_forward`)."""

_T = TypeVar("_T")


@contextmanager
def one_forward() -> Iterator[None]:
    """Within the block (one forward of the model on this thread), the attention here derives
    what it takes from a mask tensor once, at the first layer given it (the attended prefix's
    length, which waits for the mask's values, and the additive mask the kernels read), and
    the later layers reuse it. transformers builds a forward's masks before its layers and
    hands every layer of a kind the same tensor, unchanged until the forward ends; a block
    inside another starts afresh and the outer one's masks come back after it."""
    outer = getattr(_memo, "masks", None)
    _memo.masks = {}
    try:
        yield
    finally:
        _memo.masks = outer


def _per_mask(mask: Tensor, what: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """``make()``, once per ``mask`` tensor and ``what`` inside :func:`one_forward` (each
    call outside one)."""
    masks: dict[int, tuple[Tensor, dict[tuple[Any, ...], Any]]] | None
    masks = getattr(_memo, "masks", None)
    if masks is None:
        return make()
    derived = masks.setdefault(id(mask), (mask, {}))[1]  # the mask held: its id stays its own
    if what not in derived:
        derived[what] = make()
    found: _T = derived[what]
    return found


def decode_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention output ``[batch, q_len, heads, head_dim]`` (transformers' interface).

    Args:
        module: the attention module (unused beyond the fallback).
        query: ``[batch, heads, q_len, head_dim]``.
        key: ``[batch, kv_heads, kv_len, head_dim]``; ``heads`` a multiple of ``kv_heads``.
        value: ``[batch, kv_heads, kv_len, v_dim]``.
        attention_mask: boolean (True: attend) or additive float mask broadcastable to
            ``[batch, heads, q_len, kv_len]``, or None (attend to every key).
        dropout: dropout probability; anything but 0 goes to ``sdpa``.
        scaling: factor on ``q·Kᵀ``; None is ``head_dim ** -0.5``.
        **kwargs: other arguments of the interface; the unsupported ones go to ``sdpa``.
    """
    return _decode(module, query, key, value, attention_mask, dropout, scaling, True, kwargs)


def _decode(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    team: bool,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    """:func:`decode_attention`; ``team``: the compiled kernel may run the step on the
    calling thread's OpenMP team (the caller runs the model's own operations on the CPU)."""
    source = attention_mask
    if attention_mask is not None and attention_mask.shape[-1] >= key.shape[2]:
        given, kv_len = attention_mask, key.shape[2]
        used = _per_mask(given, ("used", kv_len), lambda: _attended(given, kv_len))
        key, value, attention_mask = _cut(key, value, given, used)
    if query.shape[2] != 1:
        out = _prefill_on_tiles(
            module, query, key, value, attention_mask, dropout, scaling, kwargs, source
        )
        if out is not None:
            return out, None
    if (
        query.shape[2] != 1
        or dropout != 0.0
        or kwargs.get("output_attentions", False)
        or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
        or query.shape[1] % key.shape[1] != 0
    ):
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query.reshape(batch, kv_heads, group, dim)
    mask = None
    if attention_mask is not None:
        mask = _grouped_mask(attention_mask, batch, kv_heads, group, kv_len)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if grad or key.shape[0] != batch or value.shape[0] != batch:
        out = _attend(q, key, value, mask, scale, scratch=False)
        return out.reshape(batch, 1, heads, -1), None
    threads = torch.get_num_threads()
    native = kernel() if NativeAttention.supports(key, value) else None
    if native is not None:
        q32 = q.to(torch.float32, memory_format=torch.contiguous_format)
        shape = (batch, kv_heads, group, kv_len)
        bias, grouped = None, mask
        if grouped is not None and source is not None:  # mask is cut from source
            bias = _per_mask(source, ("bias", shape), lambda: native.additive_mask(grouped, shape))
        out32 = torch.empty(batch, kv_heads, group, value.shape[-1], dtype=torch.float32)
        if team and native.team and threads > 1:
            native.attend_team(q32, key, value, bias, scale, out32, threads)
        else:
            _run(_chunks(key, value, threads), threads, lambda rows, cols: native.attend(
                q32, key, value, bias, scale, out32, rows, cols))  # fmt: skip
        return out32.to(value.dtype).reshape(batch, 1, heads, -1), None
    out = value.new_empty(batch, kv_heads, group, value.shape[-1])

    def chunk(rows: slice, cols: slice) -> None:
        out[rows, cols] = _attend(q[rows, cols], key[rows, cols], value[rows, cols],
                                  _mask_of(mask, rows, cols), scale)  # fmt: skip

    _run(_chunks(key, value, threads), threads, chunk)
    return out.reshape(batch, 1, heads, -1), None


def _prefill_on_tiles(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
    dropout: float, scaling: float | None, kwargs: dict[str, Any], source: Tensor | None = None,
) -> Tensor | None:  # fmt: skip
    """A prefill's attention on the CPU's matrix tiles, or without them on its vectors' bf16
    pair products (:meth:`~bb_lightning.engine.host_linear._Kernel.prefill_attention`), where it computes what transformers' ``sdpa``
    function would: bf16 CPU tensors with contiguous rows, no autograd graph to record, torch
    running eagerly, a head size that is a multiple of 32 up to 256, at most
    :data:`PREFILL_SCORES` scores a head, no dropout or option the kernel lacks, and a mask
    the kernel takes (:func:`_additive_mask`) or none (then causal as ``sdpa`` decides it,
    over the first ``q_len`` keys as ``sdpa`` slices them); None for every other call.
    ``source``: the mask ``mask`` was cut from, under which its additive form is kept for
    the forward's later layers (:func:`one_forward`)."""
    ts = (query, key, value)
    if (
        dropout != 0.0
        or kwargs.get("output_attentions", False)
        or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
        or any(type(t) is not Tensor or t.dim() != 4 for t in ts)
        or any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in ts)
        or any(t.stride(-1) != 1 for t in ts)
        or key.stride(2) % 2  # the kernel reads a key row as pairs
        or not eager()
        or (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
    ):
        return None
    batch, heads, q_len, dim = query.shape
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or 0 in (q_len, key.shape[2]):
        return None
    if batch * key.shape[1] < torch.get_num_threads():  # its work: one (row, key head) a thread
        return None
    if key.shape[-1] != dim or value.shape[-1] != dim or dim % 32 or dim > 256:
        return None
    if heads % key.shape[1] or -(-q_len // 32) * -(-key.shape[2] // 32) * 1024 > PREFILL_SCORES:
        return None
    tiles = host_linear.attention_kernel()
    if tiles is None:
        return None
    causal, additive = False, None
    if mask is None:
        asked = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if asked is None else asked)
        if causal:  # sdpa's upper-left causal mask over the first q_len keys
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            if key.shape[2] != q_len:
                return None
    else:
        kv_len, given = key.shape[2], mask
        what = ("additive", batch, heads, q_len, kv_len)
        additive = _per_mask(mask if source is None else source, what,
                             lambda: _additive_mask(given, batch, heads, q_len, kv_len))  # fmt: skip
        if additive is None:
            return None
    scale = dim**-0.5 if scaling is None else scaling
    return tiles.prefill_attention(query, key, value, additive, causal, scale)


PREFILL_SCORES = 1 << 19
"""Most scores (queries x keys, each rounded up to 32) of one head the matrix-tile prefill
attention serves: each thread keeps a head's scores and weights (6 bytes each) in its
caches; a longer prompt runs ``sdpa``."""


def _additive_mask(
    mask: Tensor, batch: int, heads: int, q_len: int, kv_len: int
) -> Tensor | None:  # fmt: skip
    """``mask`` as the matrix-tile attention takes it, fp32, ``[1 or batch, 1 or heads, 1 or
    q_len, kv_len]``, finite: a boolean's False and a float's -inf as fp32's lowest value,
    which leaves a weight of exactly 0 beside any key attended (a query whose every key has
    it, a left-padded prompt's padding, gets zeros, as ``sdpa`` gives); a float's finite
    values no lower than -1e36, where a score lowered by the dtype's lowest value still
    weighs 0 beside an attended key and a query whose every key is lowered so weighs them
    alike (the mean of the values, as ``sdpa`` gives). None for any other shape or dtype,
    and for a float mask holding NaN or +inf."""
    shape = tuple(mask.shape)
    if len(shape) != 4 or shape[-1] != kv_len or shape[0] not in (1, batch):
        return None
    if shape[1] not in (1, heads) or shape[2] not in (1, q_len):
        return None
    lowest = torch.finfo(torch.float32).min
    if mask.device.type != "cpu":
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.float32).masked_fill_(~mask, lowest)
    if not mask.is_floating_point():
        return None
    additive = mask.float()
    if bool(additive.isnan().any() or (additive == float("inf")).any()):
        return None
    none = additive == float("-inf")
    return additive.clamp_(min=-1e36).masked_fill_(none, lowest).contiguous()


def _run(chunks: list[tuple[slice, slice]], threads: int,
         chunk: Callable[[slice, slice], None]) -> None:  # fmt: skip
    """``chunk(rows, cols)`` for each of ``chunks``: on the calling thread where one thread
    or one chunk, else on :func:`_workers`, each worker taking the next chunk when done."""
    if threads == 1 or len(chunks) == 1:
        for rows, cols in chunks:
            chunk(rows, cols)
        return
    inference = torch.is_inference_mode_enabled()
    todo = iter(chunks)  # shared by the workers: each takes the next chunk when done

    def run(_: int) -> None:
        with torch.inference_mode(inference), torch.no_grad():
            for rows, cols in todo:
                chunk(rows, cols)

    list(_workers(threads).map(run, range(min(threads, len(chunks)))))


def _chunks(key: Tensor, value: Tensor, threads: int) -> list[tuple[slice, slice]]:
    """(sequences, key/value heads) of each chunk of a decode step on ``threads`` workers.

    One chunk (the calling thread's team runs it) up to :data:`CHUNK_BYTES` of keys and
    values in all; else whole sequences, at most :data:`CHUNK_BYTES` and at most a
    ``threads``-th of the batch a chunk, while a sequence fits and the batch gives each
    worker one; else key/value heads of one sequence, so that a few long sequences keep
    every worker busy too (one thread runs the chunks one after another).
    """
    batch, kv_heads, kv_len = key.shape[:3]
    per_head = kv_len * (key.shape[-1] * key.element_size()
                         + value.shape[-1] * value.element_size())  # fmt: skip
    per_seq = kv_heads * per_head
    if batch * per_seq <= CHUNK_BYTES:
        return [(slice(None), slice(None))]
    if per_seq <= CHUNK_BYTES and batch >= threads:
        step = max(1, min(CHUNK_BYTES // max(per_seq, 1), -(-batch // threads)))
        return [(slice(s, s + step), slice(None)) for s in range(0, batch, step)]
    per_seq_chunks = -(-threads // batch)  # chunks each sequence needs to feed the workers
    width = max(1, min(CHUNK_BYTES // max(per_head, 1), -(-kv_heads // per_seq_chunks)))
    return [(slice(s, s + 1), slice(h, h + width))
            for s in range(batch) for h in range(0, kv_heads, width)]  # fmt: skip


def _mask_of(mask: Tensor | None, rows: slice, cols: slice) -> Tensor | None:
    """A chunk's part of a grouped mask ``[batch|1, kv_heads|1, group|1, kv_len]``."""
    if mask is None:
        return None
    return mask[
        rows if mask.shape[0] > 1 else slice(None), cols if mask.shape[1] > 1 else slice(None)
    ]


def _workers(threads: int) -> ThreadPoolExecutor:
    """The pool of ``threads`` single-threaded workers decode steps run their chunks on
    (made again when the caller's intra-op team changes size, and in a forked child)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[:2] != (os.getpid(), threads):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            pool = ThreadPoolExecutor(
                threads, thread_name_prefix="bb-decode-attention", initializer=single_threaded
            )
            _pool = (os.getpid(), threads, pool)
        return _pool[2]


def _dense(t: Tensor) -> Tensor:
    """``t`` copied into this thread's scratch buffer: a reduced-precision view that is
    not contiguous (a cache cut after its written positions), which a batched product
    would copy into a fresh allocation of its own."""
    need = t.numel()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != t.dtype or buf.numel() < need:
        with torch.inference_mode(False):
            buf = torch.empty(need, dtype=t.dtype)
        _scratch.buf = buf
    return buf[:need].view(t.shape).copy_(t)


def _attend(
    q: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, scratch: bool = True
) -> Tensor:
    """One decode step's attention ``[batch, kv_heads, group, v_dim]`` of ``q`` ``[batch,
    kv_heads, group, head_dim]`` over ``key``/``value`` ``[batch, kv_heads, kv_len, *]``
    with a grouped ``mask`` ``[batch|1, kv_heads|1, group|1, kv_len]`` (see
    :func:`decode_attention`; ``scale`` multiplies ``q·Kᵀ``). With ``scratch`` a
    reduced-precision view that is not contiguous is made dense in this thread's buffer
    (not under autograd, which would keep the buffer for the backward pass)."""
    if key.dtype == torch.float32:
        # BLAS reads the keys as the left operand in their own row-major layout, any strides
        scores = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2)
        scores = scores.to(torch.float32, memory_format=torch.contiguous_format)
    else:
        if scratch and not key.is_contiguous():
            key = _dense(key)
        elif scratch:
            torch.sum(key)  # a streaming read brings the chunk's keys into the caches
        scores = torch.matmul(q, key.transpose(-1, -2)).float()
    scores.mul_(scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    probs = scores.softmax(-1).to(value.dtype)
    if scratch and value.dtype != torch.float32 and not value.is_contiguous():
        value = _dense(value)
    return torch.matmul(probs, value)


def attended_prefix(key: Tensor, value: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``key``, ``value`` and ``mask`` cut after the last key position any query attends to.

    A static KV cache is as long as the longest sequence a batch may reach, and its
    positions not written yet are masked: attention over them reads the cache and adds
    exact zeros. The cut drops them (views of the cache, no copy), so a step reads the
    tokens cached so far instead of the whole cache (a decode step's attention time grows
    with the positions it reads, masked or not). Positions masked inside the prefix
    (left padding) stay masked. ``mask`` is boolean (True: attend) or additive (masked at
    or below its dtype's lowest finite value), broadcastable to ``[batch, heads, q_len,
    kv_len]``; where no position is attended to, or every one up to the end, the inputs
    come back unchanged.
    """
    kv_len = key.shape[2]
    if mask.shape[-1] < kv_len:
        return key, value, mask
    return _cut(key, value, mask, _attended(mask, kv_len))


def _attended(mask: Tensor, kv_len: int) -> int:
    """Key positions up to and with the last of the first ``kv_len`` that any query of
    ``mask`` (as :func:`attended_prefix` takes it) attends to; ``kv_len`` where none is."""
    mask = mask[..., :kv_len]
    attended = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    last = attended.reshape(-1, kv_len).any(0).nonzero()
    return kv_len if last.numel() == 0 else int(last[-1]) + 1


def _cut(key: Tensor, value: Tensor, mask: Tensor, used: int) -> tuple[Tensor, Tensor, Tensor]:
    """``key`` and ``value`` cut to their first ``used`` positions and ``mask`` to as many
    (views; unchanged but ``mask`` cut to the keys' length where ``used`` is all of them)."""
    if used == key.shape[2]:
        return key, value, mask[..., :used]
    return key[:, :, :used], value[:, :, :used], mask[..., :used]


def _grouped_mask(mask: Tensor, batch: int, kv_heads: int, group: int, kv_len: int) -> Tensor:
    """A ``[batch|1, heads|1, 1, kv_len]`` mask viewed as ``[batch|1, kv_heads|1, group|1, kv_len]``."""
    mask = mask[..., -1:, :] if mask.ndim == 4 else mask.reshape(-1, 1, 1, mask.shape[-1])
    b, h = mask.shape[0], mask.shape[1]
    if h == 1:
        return mask.reshape(b, 1, 1, kv_len)
    return mask.reshape(b, kv_heads, group, kv_len)


def _as_sdpa(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """What the model's ``sdpa`` calls run while :func:`decode_attention_for` holds."""
    return decode_attention(module, *args, **kwargs)


def host_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Attention over a KV cache homed on the host, for a model on any device.

    A decode step (one query row) copies ``query`` and the mask to the cache's device (the
    host: a few KiB per sequence and layer), runs :func:`decode_attention` there and
    copies the ``[batch, 1, heads, v_dim]`` output to the query's device. A prefill runs
    ``sdpa`` on the query's device over the attended prefix of ``key``/``value`` copied
    there. On a CPU device the copies are no-ops (the host is the device); a cache off the
    host (a dry run's meta tensors) runs ``sdpa`` where it lies.
    """
    here = query.device
    if key.device.type != "cpu":  # a dry run's meta tensors
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[2] == 1:
        host = key.device
        mask = None if attention_mask is None else attention_mask.to(host)
        query = query.to(host)  # waits for the device's rows outside the host's turn
        with host_turn():
            out, _ = _decode(
                module, query, key, value, mask, dropout, scaling, here.type == "cpu", kwargs
            )
        return out.to(here), None
    if attention_mask is not None:
        key, value, attention_mask = attended_prefix(key, value, attention_mask)
    return sdpa_attention_forward(  # type: ignore[no-any-return]
        module, query, key.to(here), value.to(here), attention_mask,
        dropout=dropout, scaling=scaling, **kwargs,
    )  # fmt: skip


def uses_sdpa(model: nn.Module) -> bool:
    """Whether some module of ``model`` runs transformers' ``sdpa`` attention."""
    configs = (getattr(mod, "config", None) for mod in model.modules())
    return any(getattr(c, "_attn_implementation", None) == "sdpa" for c in configs)


@contextmanager
def decode_attention_for(model: nn.Module, *, host: bool = False) -> Iterator[bool]:
    """Run ``model``'s ``sdpa`` attention calls through :func:`decode_attention` when it
    uses ``sdpa`` on the CPU (the device of its first parameter or buffer; a model with
    neither is on the CPU).

    Yields whether it was installed. The model keeps ``sdpa`` as its attention
    implementation's name: transformers' attention functions map that name to
    :func:`decode_attention` meanwhile (for every model of the process), and back on
    exit (also on error). A model that branches on the name (DOTS3's indexer folds its
    top-k selection into the mask for ``"eager"`` and ``"sdpa"`` only) thus hands this
    function what it hands ``sdpa``.
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if (first is not None and first.device.type != "cpu" and not host) or not uses_sdpa(model):
        yield False
        return
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = host_attention if host else _as_sdpa
    try:
        yield True
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # the local override; the global entry stays
        if ALL_ATTENTION_FUNCTIONS["sdpa"] is not before:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = before
