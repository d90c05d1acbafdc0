"""The products of a decode step's few rows with a bf16 weight, on the CPU's matrix tiles or
its AVX-512 bf16 pair products.

A decode step multiplies one row per sequence (a few dozen to a few hundred) by each weight
of a block. torch's CPU products (oneDNN) first copy the weight into the layout of the
kernel's right operand at every call, and with so few rows that copy costs a large share of
the products; a weight paged in for one pass is used once, so no copy of it can be kept.
``host_linear.c`` multiplies with the weight as it lies in memory (its header says how): on
CPUs with bf16 matrix tiles (Intel AMX) that the operating system grants the process, as the
tiles' left operand; without them, on CPUs with AVX-512's bf16 pair products (AMD's Zen 4,
for one), each pair of a weight row's consecutive elements broadcast to every lane against
16 rows of the activations (laid out once per call, as for the tiles).

Its results are torch's in all but the order of the fp32 sums: the products of bf16 pairs
are exact in fp32 and summed in fp32 over k (on the tiles in blocks of 32, in order; on the
vectors a pair at a time, in order), then rounded once to bf16 as torch rounds; where
torch's products sum in another order (it depends on the CPU, the shape and the number of
rows), an output within an fp32 rounding of a bf16 midpoint may round the other way.

:func:`install` gives every ``nn.Linear`` of a model (the class itself, not a subclass) an
instance ``forward`` that runs the kernel where it serves the call: a contiguous bf16 CPU
input of at most :data:`MAX_ROWS` rows, a contiguous bf16 weight whose both sides are
multiples of 32, no bias, no autograd graph to record, no autocast, torch running
operations as called (:func:`~bb_lightning.engine.host_norm.eager`); every other call runs
the class's ``forward``. The inference engine installs it on a CPU device that computes in
bf16, with the norm and rotary kernels, and removes it with them; training never runs it.

The same library computes a prefill's bf16 attention, and a training step's attention forward
and backward (:meth:`_Kernel.prefill_attention`, :meth:`_Kernel.attention_forward`,
:meth:`_Kernel.attention_backward`, which :mod:`~bb_lightning.engine.attention` and
:mod:`~bb_lightning.engine.train_attention` run), on the tiles or, on a CPU without them that
has AVX-512's bf16 pair products (AMD's Zen 4, for one), on its vectors
(:func:`attention_kernel`).
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bb_lightning.engine import native
from bb_lightning.engine.host_norm import eager, plain_cpu

__all__ = ["MAX_ROWS", "install", "installed", "kernel"]

SOURCE = Path(__file__).with_name("host_linear.c")
MAX_ROWS = 256
"""Rows of input up to which the kernel serves a call (a decode step's sequences); with more,
torch's products spread their copy of the weight over enough rows to run as fast
(``bench/host_linear.py`` measures both)."""

_loaded: dict[str, _Kernel | None] = {}


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.bb_linear_bf16
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ctypes.c_int, i64, i64, i64, ptr, ptr, ptr]
        self._fn.restype = ctypes.c_int
        strides = ctypes.c_int64 * 3
        self._attend = lib.bb_prefill_attention_bf16
        self._attend.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, i64, ptr, strides, ptr,
                                 strides, ptr, strides, ptr, strides, ctypes.c_int,
                                 ctypes.c_float, ptr, ptr]  # fmt: skip
        self._attend.restype = ctypes.c_int
        self._grad = lib.bb_attention_backward_bf16
        tensors: list[Any] = [ptr, strides] * 6  # query, key, value, out, grad_out, lse
        self._grad.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, *tensors, ctypes.c_int,
                               ctypes.c_float, ptr, ptr, ptr]  # fmt: skip
        self._grad.restype = ctypes.c_int
        lib.bb_host_linear_team_threads.restype = ctypes.c_int
        self.team = bool(lib.bb_host_linear_team_threads()) and native._one_openmp_runtime()
        """Whether a call shares the weight's rows among the calling thread's OpenMP team."""
        lib.bb_linear_ready.restype = ctypes.c_int
        lib.bb_attention_ready.restype = ctypes.c_int
        self.tiles = bool(lib.bb_linear_ready())
        """Whether the products run on the matrix tiles (else on the vectors)."""
        self.kind = "tiles" if self.tiles else "vectors" if lib.bb_attention_ready() else "none"
        """Where the attention kernels' products run: ``"tiles"``, ``"vectors"`` (AVX-512's
        bf16 pair products) or ``"none"``."""

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` of contiguous bf16 ``x`` (rows of ``weight.shape[1]``) into a new
        tensor of ``x``'s shape with ``weight.shape[0]`` columns."""
        n, k = weight.shape
        rows = x.numel() // k
        out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16, device="cpu")
        threads = torch.get_num_threads() if self.team else 1
        rc = self._fn(threads, rows, n, k, x.data_ptr(), weight.data_ptr(), out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"bf16 compiled product of {rows} x {k} by {n} failed ({rc})")
        return out

    def prefill_attention(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool,
        scale: float, lse: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """Attention of bf16 ``query`` ``[batch, heads, q_len, dim]`` over ``key`` and
        ``value`` ``[batch, kv_heads, kv_len, dim]`` (``heads`` a multiple of ``kv_heads``;
        each tensor's rows contiguous), with an additive fp32 ``mask`` broadcastable to
        ``[batch, heads, q_len, kv_len]`` (finite, its rows contiguous) or, ``causal``, query
        ``i`` attending keys ``j <= i``; into a new ``[batch, q_len, heads, dim]`` tensor, and
        each query's log-sum-exp of its scaled, masked scores into a contiguous fp32 ``lse``
        ``[batch, heads, q_len]`` where given. ``dim`` is a multiple of 32, at most 256."""
        batch, heads, q_len, dim = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        out = torch.empty(batch, q_len, heads, dim, dtype=torch.bfloat16, device="cpu")
        arrays = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, key, value)]
        if mask is None:
            m, mstride = None, (ctypes.c_int64 * 3)(0, 0, 0)
        else:
            m = mask.data_ptr()
            mstride = (ctypes.c_int64 * 3)(*(
                0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3)))  # fmt: skip
        threads = torch.get_num_threads() if self.team else 1
        rc = self._attend(threads, batch, heads, kv_heads, q_len, kv_len, dim,
                          query.data_ptr(), arrays[0], key.data_ptr(), arrays[1],
                          value.data_ptr(), arrays[2], m, mstride, int(causal), scale,
                          out.data_ptr(), None if lse is None else lse.data_ptr())  # fmt: skip
        if rc != 0:
            raise RuntimeError(
                f"bf16 compiled attention of {q_len} queries over {kv_len} keys failed ({rc})"
            )
        return out

    def attention_forward(
        self, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """:meth:`prefill_attention` without a mask, and each query's fp32 log-sum-exp of its
        scaled scores: the output ``[batch, len, heads, dim]`` and ``lse`` ``[batch, heads,
        len]``, what :meth:`attention_backward` takes."""
        batch, heads, length, _ = query.shape
        lse = torch.empty(batch, heads, length, dtype=torch.float32, device="cpu")
        return self.prefill_attention(query, key, value, None, causal, scale, lse), lse

    def attention_backward(
        self, query: Tensor, key: Tensor, value: Tensor, out: Tensor, grad_out: Tensor,
        lse: Tensor, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The gradients of bf16 self-attention with respect to ``query`` ``[batch, heads,
        len, dim]``, ``key`` and ``value`` ``[batch, kv_heads, len, dim]`` (``heads`` a
        multiple of ``kv_heads``), given its bf16 output ``out`` and its gradient ``grad_out``
        (``[batch, heads, len, dim]``) and the fp32 log-sum-exp of each query's scaled scores
        ``lse`` ``[batch, heads, len]``, as torch's fused CPU attention returns them; every
        bf16 tensor's rows contiguous. ``causal``: query ``i`` attends keys ``j <= i``; the
        scores are scaled by ``scale``. Returns new contiguous bf16 tensors of the inputs'
        shapes (a key/value head's gradients summed over its query heads). ``dim`` is a
        multiple of 32, at most 256."""
        batch, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        dq = torch.empty(batch, heads, length, dim, dtype=torch.bfloat16, device="cpu")
        dk = torch.empty(batch, kv_heads, length, dim, dtype=torch.bfloat16, device="cpu")
        dv = torch.empty_like(dk)
        tensors = (query, key, value, out, grad_out, lse)
        pairs = [x for t in tensors for x in (t.data_ptr(), (ctypes.c_int64 * 3)(*t.stride()[:3]))]
        threads = torch.get_num_threads() if self.team else 1
        rc = self._grad(threads, batch, heads, kv_heads, length, dim, *pairs, int(causal), scale,
                        dq.data_ptr(), dk.data_ptr(), dv.data_ptr())  # fmt: skip
        if rc != 0:
            raise RuntimeError(
                f"bf16 compiled attention backward of {length} positions failed ({rc})"
            )
        return dq, dk, dv


def kernel() -> _Kernel | None:
    """The compiled product of few rows, built on first call: on the matrix tiles, or without
    them on AVX-512's bf16 pair products (:attr:`_Kernel.kind`); None where ``BB_NATIVE=0``,
    where it cannot be built, or where the CPU has neither."""
    return native.once(_loaded, _load)


def attention_kernel() -> _Kernel | None:
    """The compiled library whose attention kernels (:meth:`_Kernel.prefill_attention`,
    :meth:`_Kernel.attention_backward`) run here, on the matrix tiles or, without them, on
    AVX-512's bf16 pair products (:attr:`_Kernel.kind`); None where ``BB_NATIVE=0``, where it
    cannot be built, or where the CPU has neither."""
    return native.once(_loaded, _load)  # loaded only where its attention runs


def _load(compiler: str) -> _Kernel | None:
    if shutil.which(compiler) is None:
        return None  # the decode attention kernel's loader says so once
    if not {"avx512bw", "avx512_bf16"} <= native._cpu_flags():
        return None  # neither the tiles nor the vectors' bf16 pair products to build for
    lib = native.load_library(SOURCE, compiler, "bf16 products with few rows run torch's")
    if lib is None:
        return None
    kern = _Kernel(lib)
    return kern if kern.kind != "none" else None


def _forward(kern: _Kernel, module: nn.Module, input: Tensor) -> Tensor:
    x, w = input, getattr(module, "weight", None)
    if (
        not eager()
        or torch.is_autocast_enabled("cpu")
        or getattr(module, "bias", None) is not None
        or not isinstance(w, Tensor)
        or not plain_cpu(x, w)
        or x.dtype != torch.bfloat16
        or w.dtype != torch.bfloat16
        or w.ndim != 2
        or x.ndim < 1
        or x.shape[-1] != w.shape[1]
        or w.shape[0] % 32 != 0
        or w.shape[1] % 32 != 0
        or not 0 < x.numel() <= MAX_ROWS * w.shape[1]
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        or not w.is_contiguous()
        or not x.is_contiguous()
    ):
        return nn.Linear.forward(module, input)  # type: ignore[arg-type]
    return kern(x, w)


def installed(forward: object) -> bool:
    """Whether ``forward`` (a module's instance ``forward``) is one :func:`install` gave."""
    func = getattr(forward, "__func__", None)
    return isinstance(func, functools.partial) and func.func is _forward


def install(model: nn.Module) -> Callable[[], None]:
    """Give each ``nn.Linear`` of ``model`` (its class exactly) the kernel's ``forward``;
    return the function that restores the class ``forward`` to all of them. Nothing changes
    where the kernel is unavailable (:func:`kernel` is None)."""
    kern = kernel()
    if kern is None:
        return lambda: None
    swapped: list[tuple[nn.Module, object]] = []
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in vars(module):
            ours = types.MethodType(functools.partial(_forward, kern), module)
            module.forward = ours  # type: ignore[method-assign]
            swapped.append((module, ours))

    def restore() -> None:  # a forward set over ours since stays
        for module, ours in swapped:
            if vars(module).get("forward") is ours:
                del vars(module)["forward"]
        swapped.clear()

    return restore
