"""Llama-family RMS norms of a forward without grad through a compiled kernel on the host.

Hugging Face's ``LlamaRMSNorm`` (and the many classes that copy its ``forward``: Mistral,
Qwen2, Qwen3, Phi-3, ...) runs as seven torch operations, each a pass over the
activations, the first an fp32 copy of a bf16 input. In a CPU prefill these passes cost
about as much as a block's attention products. ``host_ops.c`` does the same arithmetic in
one pass over each row (its header says how the roundings match), built and cached like
the decode attention kernel (:mod:`~bb_lightning.engine.native`); the same library holds
the rotary embedding that :mod:`~bb_lightning.engine.host_rope` serves, the gated MLP's
activation (:mod:`~bb_lightning.engine.host_mlp`), training's fp32 gradient sums
(:meth:`_Kernel.sum_into`, which :mod:`~bb_lightning.engine.grad_sink` calls) and its AdamW
(:meth:`_Kernel.adamw`, which :mod:`~bb_lightning.engine.optim` calls).

:func:`install` gives every module of a model whose class ``forward`` reads as
:data:`PLAIN_RMS_NORM` (:func:`reads_as`) an instance ``forward`` that calls the kernel; any
other norm (Gemma's ``1 + weight``, a norm that multiplies before its cast) keeps its own.
The kernel serves a call only where it computes what the class would: a CPU tensor of
fp32 or bf16 whose rows are contiguous, a weight of the same dtype, and no autograd graph
to record; every other call runs the class ``forward``. The inference engine installs it
on a CPU device and removes it when it closes (:class:`~bb_lightning.engine.inference.
InferenceEngine`); training never runs it (its backward needs the class's operations).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import shutil
import textwrap
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bb_lightning.engine import native

__all__ = [
    "PLAIN_RMS_NORM",
    "code_shape",
    "eager",
    "install",
    "kernel",
    "plain_cpu",
    "plain_rms_norm",
    "reads_as",
    "swap_forwards",
]

SOURCE = Path(__file__).with_name("host_ops.c")
PLAIN_RMS_NORM = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
"""The ``forward`` the kernel computes (:func:`reads_as`: annotations and comments aside)."""
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Dtypes the kernel reads and writes, with its code for each."""

_plain: dict[type, bool] = {}
_loaded: dict[str, _Kernel | None] = {}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.bb_rms_norm
        self._fn.argtypes = [ctypes.c_int, ctypes.c_int, _I64, _I64, _PTR, _I64, _PTR, _PTR,
                             ctypes.c_float]  # fmt: skip
        self._fn.restype = ctypes.c_int
        self._rope = lib.bb_rope
        strides = ctypes.POINTER(_I64)
        self._rope.argtypes = [ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64, _PTR, strides,
                               _PTR, strides, _PTR, strides, _PTR, strides]  # fmt: skip
        self._rope.restype = ctypes.c_int
        lib.bb_host_ops_team_threads.restype = ctypes.c_int
        self.team = bool(lib.bb_host_ops_team_threads()) and native._one_openmp_runtime()
        """Whether a call shares its rows among the calling thread's OpenMP team."""
        self._norm_back = lib.bb_rms_norm_backward
        self._norm_back.argtypes = [ctypes.c_int, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                    ctypes.c_float]  # fmt: skip
        self._norm_back.restype = ctypes.c_int
        self._silu_mul = lib.bb_silu_mul
        self._silu_mul.argtypes = [ctypes.c_int, _I64, _PTR, _PTR, _PTR, _PTR]
        self._silu_mul.restype = ctypes.c_int
        self._silu_table = torch.nn.functional.silu(_every_bf16()).float()
        """torch's bf16 ``F.silu`` of each bf16 bit pattern, as floats (the kernel's table)."""
        self._silu_back = lib.bb_silu_mul_backward
        self._silu_back.argtypes = [ctypes.c_int, _I64, *[_PTR] * 7]
        self._silu_back.restype = ctypes.c_int
        self._dsilu_table = _silu_derivative(_every_bf16())
        """The SiLU's derivative at each bf16 bit pattern, in float64 rounded to fp32."""
        self.rope_dtypes = frozenset(d for d in DTYPES if self._rope_exact(d))
        """Dtypes whose rotary embedding the build computes bit for bit as torch's operations
        (checked at load: a compiler that fuses the fp32 products into multiply-adds despite
        the source's pragma loses fp32)."""
        self._sum = lib.bb_sum_f32
        self._sum.argtypes = [ctypes.c_int, _I64, _PTR, ctypes.c_int, _PTR, _PTR, ctypes.c_int]
        self._sum.restype = ctypes.c_int
        self.sum_exact = self._sum_exact()
        """Whether :meth:`sum_into` equals torch's conversions and adds bit for bit (checked
        at load; where not, :meth:`sum_into` declines every call)."""
        self._adamw = lib.bb_adamw
        self._adamw.argtypes = [ctypes.c_int, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int, _PTR,
                                _PTR, _PTR, ctypes.c_int, _PTR]  # fmt: skip
        self._adamw.restype = ctypes.c_int
        self.adamw_exact = self._adamw_exact()
        """Whether :meth:`adamw` equals torch's ``_fused_adamw_`` bit for bit (checked at load
        against torch's vector loop; where not, or where torch has no fused AdamW,
        :meth:`adamw` declines every call)."""
        self.silu_mul_exact = self._silu_mul_exact()
        """Whether :meth:`silu_mul` equals torch's ``F.silu(g) * u`` bit for bit (checked at
        load on every bf16 ``g``)."""

    def __call__(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """The norm of contiguous ``x`` (rows of ``weight.numel()`` elements) into a new
        tensor of its shape."""
        dim = weight.numel()
        rows = x.numel() // dim
        y = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        threads = torch.get_num_threads() if self.team else 1
        rc = self._fn(threads, DTYPES[x.dtype], rows, dim, x.data_ptr(), dim,
                      weight.data_ptr(), y.data_ptr(), eps)  # fmt: skip
        if rc != 0:
            raise ValueError(f"RMS norm kernel: dtype {x.dtype} unsupported")
        return y

    def norm_backward(
        self, x: Tensor, weight: Tensor, grad: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """(the input's gradient, the weight's gradient in fp32) of the bf16 norm of
        contiguous ``x`` (rows of ``weight.numel()`` elements) given the output's contiguous
        bf16 gradient ``grad`` (the kernel's ``bb_rms_norm_backward``)."""
        dim = weight.numel()
        rows = x.numel() // dim
        threads = max(1, min(torch.get_num_threads() if self.team else 1, rows))
        dx = torch.empty(x.shape, dtype=torch.bfloat16, device="cpu")
        parts = torch.empty(threads, dim, dtype=torch.float32, device="cpu")
        self._norm_back(threads, rows, dim, x.data_ptr(), weight.data_ptr(), grad.data_ptr(),
                        dx.data_ptr(), parts.data_ptr(), eps)  # fmt: skip
        return dx, parts.sum(0)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        """``F.silu(gate) * up`` of contiguous bf16 ``gate`` and ``up`` of one shape, in one
        pass, into a new tensor of that shape (the SiLU looked up in torch's own results)."""
        y = torch.empty(gate.shape, dtype=torch.bfloat16, device="cpu")
        threads = torch.get_num_threads() if self.team else 1
        self._silu_mul(threads, gate.numel(), gate.data_ptr(), up.data_ptr(),
                       self._silu_table.data_ptr(), y.data_ptr())  # fmt: skip
        return y

    def silu_mul_backward(self, gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        """The gradients (of ``gate``, of ``up``) of :meth:`silu_mul` given its output's
        gradient ``grad``: contiguous bf16 tensors of one shape, in one pass (the kernel's
        ``bb_silu_mul_backward``; ``up``'s gradient is torch's bit for bit, ``gate``'s computed
        in fp32 and rounded once)."""
        dg = torch.empty(gate.shape, dtype=torch.bfloat16, device="cpu")
        du = torch.empty(gate.shape, dtype=torch.bfloat16, device="cpu")
        threads = torch.get_num_threads() if self.team else 1
        self._silu_back(threads, gate.numel(), gate.data_ptr(), up.data_ptr(), grad.data_ptr(),
                        self._silu_table.data_ptr(), self._dsilu_table.data_ptr(),
                        dg.data_ptr(), du.data_ptr())  # fmt: skip
        return dg, du

    def sum_into(self, dst: Tensor, srcs: Sequence[Tensor], *, into: bool) -> bool:
        """``dst (+)= srcs[0] + srcs[1] + ...`` in fp32, left to right, in one pass (the
        kernel's ``bb_sum_f32``): ``into`` adds to what ``dst`` holds, else ``srcs[0]`` is
        copied in. Returns False, having done nothing, unless ``dst`` is a contiguous fp32
        CPU tensor and every source a contiguous fp32 or bf16 CPU tensor of its ``numel``
        (the caller then sums them itself)."""
        n = dst.numel()
        if not self.sum_exact or not srcs or dst.dtype != torch.float32 or not _flat_cpu(dst):
            return False
        for s in srcs:
            if s.dtype not in DTYPES or s.numel() != n or not _flat_cpu(s):
                return False
        ptrs = (ctypes.c_void_p * len(srcs))(*(s.data_ptr() for s in srcs))
        codes = (ctypes.c_int * len(srcs))(*(DTYPES[s.dtype] for s in srcs))
        threads = torch.get_num_threads() if self.team else 1
        return self._sum(threads, n, dst.data_ptr(), len(srcs), ptrs, codes, int(into)) == 0

    def _sum_exact(self) -> bool:
        g = torch.Generator().manual_seed(0)
        a, b, c = (torch.randn(70_001, generator=g).mul(1e3) for _ in range(3))
        srcs = [a.to(torch.bfloat16), b, c.to(torch.bfloat16)]
        srcs[0][:7] = -0.0
        self.sum_exact = True  # sum_into serves while it is checked
        dst = torch.full_like(a, float("nan"))
        expect = srcs[0].float()
        copied = self.sum_into(dst, srcs[:1], into=False)
        ok = copied and torch.equal(dst, expect) and torch.equal(dst.signbit(), expect.signbit())
        for s in srcs[1:]:
            expect.add_(s.float())
        ok = ok and self.sum_into(dst.fill_(float("nan")), srcs, into=False)
        ok = ok and torch.equal(dst, expect)
        expect.add_(srcs[0].float())
        ok = ok and self.sum_into(dst, srcs[:1], into=True) and torch.equal(dst, expect)
        return bool(ok)

    def adamw(
        self,
        state: Sequence[Tensor],
        acc: Tensor | None,
        srcs: Sequence[Tensor],
        out: Tensor | None,
        scalars: Sequence[float],
    ) -> bool:
        """One AdamW update of ``state`` (contiguous fp32 master weights, first and second
        moments, of one size, in place) by the gradient ``acc + srcs[0] + srcs[1] + ...``
        (fp32 accumulator or None, then fp32 or bf16 sources, summed as :meth:`sum_into`
        sums; no gradient at all: zeros), the updated weights also written to ``out`` (fp32
        or bf16) when given, in one pass (the kernel's ``bb_adamw``). ``scalars``: the
        kernel's ten, from :func:`~bb_lightning.engine.optim.adam_scalars`. Returns False,
        having done nothing, unless every tensor is a contiguous CPU tensor of that size
        and dtype (the caller then steps them itself)."""
        n = state[0].numel()
        if not self.adamw_serves(state, acc, srcs, out):
            return False
        if any(t.numel() != n for t in [*state, *srcs, *([] if acc is None else [acc])]):
            return False
        if out is not None and out.numel() != n:
            return False
        ptrs = (ctypes.c_void_p * max(len(srcs), 1))(*(s.data_ptr() for s in srcs))
        codes = (ctypes.c_int * max(len(srcs), 1))(*(DTYPES[s.dtype] for s in srcs))
        h = (ctypes.c_float * len(scalars))(*scalars)
        threads = torch.get_num_threads() if self.team else 1
        master, exp_avg, exp_avg_sq = (t.data_ptr() for t in state)
        rc = self._adamw(threads, n, master, exp_avg, exp_avg_sq,
                         None if acc is None else acc.data_ptr(), len(srcs), ptrs, codes,
                         None if out is None else out.data_ptr(),
                         0 if out is None else DTYPES[out.dtype], h)  # fmt: skip
        return rc == 0

    def adamw_serves(
        self,
        state: Sequence[Tensor],
        acc: Tensor | None,
        srcs: Sequence[Tensor],
        out: Tensor | None,
    ) -> bool:
        """Whether :meth:`adamw` serves tensors of these dtypes and layouts (sizes aside):
        fp32 state and accumulator, fp32 or bf16 sources and output, all contiguous on the
        host, and the load check passed."""
        fp32 = [*state, *([] if acc is None else [acc])]
        other = [*srcs, *([] if out is None else [out])]
        return (
            self.adamw_exact
            and len(state) == 3
            and all(t.dtype == torch.float32 and _flat_cpu(t) for t in fp32)
            and all(t.dtype in DTYPES and _flat_cpu(t) for t in other)
        )

    def _adamw_exact(self) -> bool:
        if not hasattr(torch, "_fused_adamw_"):
            return False
        from bb_lightning.engine.optim import AdamWConfig, adam_scalars

        self.adamw_exact = True  # adamw serves while it is checked
        g = torch.Generator().manual_seed(0)
        n = 16 * 801  # torch's vector loop only: it computes a call's last n % 16 another way
        ok = True
        for cfg, lr, step, scale in (
            (AdamWConfig(betas=(0.9, 0.95), weight_decay=0.1), 3e-4, 3, 0.37),
            (AdamWConfig(betas=(0.3, 0.999), eps=1e-6), 1e-2, 1, 1.0),
        ):
            state = [torch.randn(n, generator=g).mul(s) for s in (1.0, 1e-2, 1e-2)]
            state[2].square_()
            acc = torch.randn(n, generator=g).mul(1e-2)
            src = torch.randn(n, generator=g).mul(1e-2).to(torch.bfloat16)
            expect = [t.clone() for t in state]
            torch._fused_adamw_(
                [expect[0]], [acc + src.float()], [expect[1]], [expect[2]], [],
                [torch.tensor(float(step))], lr=lr, beta1=cfg.betas[0], beta2=cfg.betas[1],
                weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
                grad_scale=None if scale == 1.0 else torch.tensor(1.0 / scale), found_inf=None,
            )  # fmt: skip
            out = torch.empty(n, dtype=torch.bfloat16)
            ok = ok and self.adamw(state, acc, [src], out, adam_scalars(cfg, lr, step, scale))
            ok = ok and all(torch.equal(a, b) for a, b in zip(state, expect, strict=True))
            ok = ok and torch.equal(out, expect[0].to(torch.bfloat16))
        return bool(ok)

    def _silu_mul_exact(self) -> bool:
        g = torch.Generator().manual_seed(0)
        gate, up = _every_bf16(), torch.randn(1 << 16, generator=g).mul(4).to(torch.bfloat16)
        mine, torch_s = self.silu_mul(gate, up), torch.nn.functional.silu(gate) * up
        return torch.equal(mine.isnan(), torch_s.isnan()) and torch.equal(
            mine.nan_to_num(0.0), torch_s.nan_to_num(0.0)
        )

    def _rope_exact(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`rope` equals torch's operations bit for bit on a fixed input."""
        g = torch.Generator().manual_seed(0)
        x, c, s = (torch.randn(2, 3, 5, 40, generator=g).mul(4).to(dtype) for _ in range(3))
        half = torch.cat((-x[..., 20:], x[..., :20]), dim=-1)
        return torch.equal(self.rope(x, c, s), (x * c) + (half * s))

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The rotary embedding of ``x`` ``[n0, n1, n2, dim]`` (rows contiguous) by ``cos``
        and ``sin`` of its shape (broadcast views: a stride of 0 repeats a row), into a new
        tensor of ``x``'s shape and layout (:func:`torch.empty_like`)."""
        y = torch.empty_like(x)
        order = (*sorted(range(3), key=lambda d: -x.stride()[d]), 3)  # rows in memory order
        ts = [t.permute(order) for t in (x, cos, sin, y)]
        strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in ts]
        threads = torch.get_num_threads() if self.team else 1
        rc = self._rope(threads, DTYPES[x.dtype], *ts[0].shape, x.data_ptr(), strides[0],
                        cos.data_ptr(), strides[1], sin.data_ptr(), strides[2], y.data_ptr(),
                        strides[3])  # fmt: skip
        if rc != 0:
            raise ValueError(f"rotary kernel: dtype {x.dtype} or odd width {x.shape[-1]}")
        return y


def _flat_cpu(t: Tensor) -> bool:
    """A contiguous strided CPU tensor outside autograd (:func:`plain_cpu`)."""
    return plain_cpu(t, t) and t.is_contiguous() and not t.requires_grad


def _silu_derivative(x: Tensor) -> Tensor:
    """``d silu(v) / dv = sigmoid(v) * (1 + v * (1 - sigmoid(v)))`` at each of ``x``, in
    float64 rounded to fp32 (1 at +inf, 0 at -inf, NaN at NaN)."""
    v = x.double()
    s = torch.sigmoid(v)
    d = s * (1 + v * (1 - s))
    d = torch.where(v == float("inf"), 1.0, torch.where(v == float("-inf"), 0.0, d))
    return d.float()


def _every_bf16() -> Tensor:
    """Each of the 65,536 bf16 values, the one of bit pattern ``i`` at index ``i``."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).roll(1 << 15).view(torch.bfloat16)


def kernel() -> _Kernel | None:
    """The compiled norm and rotary embedding, built on first call; None where
    ``BB_NATIVE=0`` or where it cannot be built (a warning says why, once per process)."""
    return native.once(_loaded, _load)


def _load(compiler: str) -> _Kernel | None:
    if shutil.which(compiler) is None:
        return None  # the decode attention kernel's loader says so once
    lib = native.load_library(
        SOURCE, compiler, "RMS norms and rotary embeddings run torch's operations"
    )
    return None if lib is None else _Kernel(lib)


def code_shape(source: str) -> str:
    """The function ``source`` defines, as an AST dump without its docstring, decorators and
    annotations ("" where ``source`` does not begin with a function): two functions of one
    shape compute the same operations whatever their comments and layout."""
    tree = ast.parse(textwrap.dedent(source))
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return ""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    args = fn.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None
    return ast.dump(ast.FunctionDef(name=fn.name, args=args, body=body, decorator_list=[]))


def reads_as(fn: object, shape: str) -> bool:
    """Whether Python function ``fn``'s source has :func:`code_shape` ``shape``."""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        return code_shape(inspect.getsource(fn)) == shape
    except (OSError, TypeError, SyntaxError):
        return False


_NORM_SHAPE = code_shape(PLAIN_RMS_NORM)


def plain_rms_norm(kind: type) -> bool:
    """Whether ``kind.forward`` reads as :data:`PLAIN_RMS_NORM` (:func:`reads_as`)."""
    known = _plain.get(kind)
    if known is None:
        known = _plain[kind] = reads_as(getattr(kind, "forward", None), _NORM_SHAPE)
    return known


def eager() -> bool:
    """Whether torch runs operations as called: no tracing (``torch.jit.trace``, a
    ``torch.compile`` trace), no function transform (``vmap``, ``grad``), no forward-mode AD
    level and no dispatch mode (a fake or counting mode) is active, any of which a kernel that
    reads data pointers would bypass."""
    return not (
        torch.jit.is_tracing()
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch.autograd.forward_ad._current_level >= 0
        or torch._C._len_torch_dispatch_stack() > 0
    )


def plain_cpu(x: object, w: object) -> bool:
    """Whether ``x`` (a tensor) and ``w`` (a tensor or a parameter) are strided CPU tensors,
    ``x`` not nested: what a kernel that reads their data pointers can take."""
    return (
        isinstance(x, Tensor)
        and isinstance(w, Tensor)
        and type(x) is Tensor
        and type(w) in (Tensor, nn.Parameter)
        and x.layout == torch.strided
        and w.layout == torch.strided
        and not x.is_nested
        and x.device.type == "cpu"
        and w.device.type == "cpu"
    )


def _forward(kern: _Kernel, module: nn.Module, hidden_states: Tensor) -> Tensor:
    x, w = hidden_states, getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if (
        not eager()
        or not isinstance(w, Tensor)
        or not plain_cpu(x, w)
        or x.dtype not in DTYPES
        or w.dtype != x.dtype
        or w.ndim != 1
        or x.ndim < 1
        or x.shape[-1] != w.numel()
        or not isinstance(eps, float)
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        or not w.is_contiguous()
        or not x.is_contiguous()
    ):
        return type(module).forward(module, hidden_states)  # type: ignore[no-any-return]
    return kern(x, w, eps)


def install(model: nn.Module) -> Callable[[], None]:
    """Give each plain RMS norm of ``model`` (:func:`plain_rms_norm`) the kernel's
    ``forward``; return the function that restores the class ``forward`` to all of them.
    Nothing changes where the kernel is unavailable (:func:`kernel` is None)."""
    kern = kernel()
    if kern is None:
        return lambda: None
    return swap_forwards(model, plain_rms_norm, functools.partial(_forward, kern))


def swap_forwards(
    model: nn.Module,
    plain: Callable[[type], bool],
    forward: Callable[..., Any],
    over: Callable[[object], bool] | None = None,
) -> Callable[[], None]:
    """Give each module of ``model`` whose class ``plain`` accepts (and that has no
    instance ``forward`` of its own, or one that ``over`` accepts) ``forward`` bound to it as
    its instance ``forward``; return the function that takes those back (the class
    ``forward``, or the instance ``forward`` it had, runs again)."""
    swapped: list[tuple[nn.Module, object]] = []
    for module in model.modules():
        before = vars(module).get("forward")
        if plain(type(module)) and (before is None or (over is not None and over(before))):
            module.forward = types.MethodType(forward, module)
            swapped.append((module, before))

    def restore() -> None:
        for module, before in swapped:
            if before is None:
                vars(module).pop("forward", None)
            else:
                module.forward = before  # type: ignore[assignment]
        swapped.clear()

    return restore
