"""The host decode attention kernel in C (``decode_attention.c``), compiled on first use.

A decode step's attention reads each cached key and value once against a few FLOPs
each; torch's batched products for these skinny shapes (one row per query head of a
group) run far below the rate the host reads memory at. The C kernel widens each cached
row to fp32 in registers and keeps its products on independent vector accumulators (see
the source's header), so it reads the cache near the host's memory rate where the
products cannot.

It is compiled once per machine and source with the C compiler the Python headers'
packages use (``$CC``, else ``cc``) for the host's own vector instructions
(``-march=native``), into ``$BB_NATIVE_DIR`` (default ``~/.cache/balance_beam/native``),
keyed by the source, the flags and the CPU's model and feature flags, and loaded with
:mod:`ctypes` (whose calls release the GIL, so a pool of threads runs it side by side).
It is built with OpenMP where the compiler has it: :meth:`NativeAttention.attend_team`
then runs a whole step on the calling thread's OpenMP team, the threads that run torch's
own operations for that thread, provided the process holds one OpenMP runtime (torch's;
see :func:`_one_openmp_runtime`).
Where it cannot be built (no compiler, an unsupported platform), where the machine's
vectors are narrower than :data:`MIN_LANES` floats, or with ``BB_NATIVE=0``, :func:`kernel`
returns None and decode attention runs torch's products instead, with the same results to
fp32 rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["NativeAttention", "kernel", "load_library", "once"]

T = TypeVar("T")

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
"""Compiler flags; ``-ffast-math`` holds because the kernel's inputs are finite (masks are
clamped, see :meth:`NativeAttention.additive_mask`). The object is linked in a second step
without them: linked with ``-ffast-math``, a library sets flush-to-zero for the whole process
when loaded (subnormal floats read as zero in every other computation)."""
OPENMP = "-fopenmp"
"""Added to the compile and link steps where the compiler takes it (else built without)."""
MIN_LANES = 16
"""Floats a vector register of the machine must hold for :func:`kernel` to use the kernel
(AVX-512's 16). Built for AVX2's 8, it read a cache 1.5-4 x slower than torch's products with
both held to AVX2 on one machine (GQA layers slowest): there decode attention keeps torch's
products."""
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Cache dtypes the kernel reads, with its code for each."""
MASK_FLOOR = -1e30
"""Where an additive mask is lower it is clamped to this (finite, and ``exp`` of a score
this far below the row's largest is an exact 0 in fp32)."""

_lock = threading.RLock()
_loaded: dict[str, NativeAttention | None] = {}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES: list[Any] = [ctypes.c_int, *([_I64] * 9), _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64,
             _PTR, _I64, _I64, _I64, ctypes.c_float, _PTR]  # fmt: skip


class NativeAttention:
    """The loaded kernel: :meth:`attend` runs one range of sequences and key/value heads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.bb_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._team = lib.bb_decode_attention_team
        self._team.argtypes = [ctypes.c_int, *_ARGTYPES]
        self._team.restype = ctypes.c_int
        lib.bb_decode_attention_team_threads.restype = ctypes.c_int
        self.team = bool(lib.bb_decode_attention_team_threads()) and _one_openmp_runtime()
        """Whether :meth:`attend_team` runs on a team of threads (else on the caller's)."""
        self._wide = lib.bb_decode_attention_wide
        self._wide.argtypes = [ctypes.c_int]
        self._wide.restype = ctypes.c_int
        self.set_wide(_cpu_vendor() == "GenuineIntel")
        self._tiles = lib.bb_decode_attention_tiles
        self._tiles.argtypes = [ctypes.c_int]
        self._tiles.restype = ctypes.c_int
        self._fits_tiles = lib.bb_decode_attention_fits_tiles
        self._fits_tiles.argtypes = [_I64, _I64, _I64, _I64]
        self._fits_tiles.restype = ctypes.c_int
        self.set_tiles(True)

    def set_wide(self, wide: bool) -> bool:
        """Take 512-bit vectors for the products of four query heads' keys (else 256-bit);
        returns whether the kernel now does (False where it has no such products).

        Set at load for the CPU's maker: Intel's cores run a 512-bit ``vdpbf16ps`` at the
        rate of a 256-bit one (on a Xeon with AMX the GQA layer's products from the caches
        took 1.25 x as long with 256-bit vectors), AMD's Zen 4 runs two 256-bit ones a
        cycle and splits a 512-bit one in two."""
        return bool(self._wide(int(wide)))

    def set_tiles(self, on: bool) -> bool:
        """Run bf16 heads of 4, 8 or 16 query heads a key/value head, and of 1 or 2 over 288
        positions or more (keys of 32-128 elements, values in steps of 32), on the CPU's
        matrix tiles (Intel's AMX); returns whether the kernel now does (False where the CPU
        has no tiles or the kernel was not built for them). On at load where it can be."""
        return bool(self._tiles(int(on)))

    def on_tiles(self, group: int, positions: int, dim: int, vdim: int, dtype: torch.dtype) -> bool:
        """Whether heads of ``group`` query heads a key/value head over ``positions`` cached
        positions, keys of ``dim`` and values of ``vdim`` elements in ``dtype`` run on the
        matrix tiles now."""
        return dtype == torch.bfloat16 and bool(self._fits_tiles(group, positions, dim, vdim))

    @staticmethod
    def supports(key: Tensor, value: Tensor) -> bool:
        """Whether the kernel reads ``key``/``value`` ``[batch, kv_heads, kv_len, dim]``: on
        the CPU, of one dtype it reads, each row contiguous."""
        return (
            key.device.type == "cpu"
            and value.device.type == "cpu"
            and key.dtype in DTYPES
            and value.dtype == key.dtype
            and key.stride(-1) == 1
            and value.stride(-1) == 1
        )

    @staticmethod
    def additive_mask(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
        """``mask`` (boolean, True: attend; or additive) as an fp32 additive mask clamped at
        :data:`MASK_FLOOR`, expanded to ``shape`` ``[batch, kv_heads, group, kv_len]``
        (broadcast dimensions keep stride 0) with its last dimension contiguous."""
        if mask.dtype == torch.bool:
            out = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, MASK_FLOOR)
        else:
            out = mask.to(torch.float32).clamp(min=MASK_FLOOR)
        if out.stride(-1) != 1:
            out = out.contiguous()
        return out.expand(shape)

    def attend(
        self,
        q: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        scale: float,
        out: Tensor,
        rows: slice,
        cols: slice,
    ) -> None:
        """Write attention of sequences ``rows`` x key/value heads ``cols`` into ``out``.

        ``q`` ``[batch, kv_heads, group, dim]`` and ``out`` ``[batch, kv_heads, group, v_dim]``
        fp32 and contiguous; ``key``/``value`` as :meth:`supports` accepts; ``bias`` from
        :meth:`additive_mask` or None; ``scale`` multiplies ``q·Kᵀ``.
        """
        self._call(self._fn, (), q, key, value, bias, scale, out, rows, cols)

    def attend_team(
        self, q: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scale: float,
        out: Tensor, threads: int,
    ) -> None:  # fmt: skip
        """:meth:`attend` of every sequence and head, on the calling thread's OpenMP team of
        ``threads`` (where :attr:`team`; else on the calling thread alone)."""
        whole = slice(None)
        self._call(self._team, (threads,), q, key, value, bias, scale, out, whole, whole)

    @staticmethod
    def _call(
        fn: Any, first: tuple[int, ...], q: Tensor, key: Tensor, value: Tensor,
        bias: Tensor | None, scale: float, out: Tensor, rows: slice, cols: slice,
    ) -> None:  # fmt: skip
        batch, kv_heads, group, dim = q.shape
        b0, b1, _ = rows.indices(batch)
        h0, h1, _ = cols.indices(kv_heads)
        mask = (0, 0, 0, 0) if bias is None else (bias.data_ptr(), *bias.stride()[:3])
        rc = fn(
            *first, DTYPES[key.dtype], b0, b1, h0, h1, kv_heads, group, key.shape[2], dim,
            value.shape[-1], q.data_ptr(), key.data_ptr(), *key.stride()[:3],
            value.data_ptr(), *value.stride()[:3], *mask, scale, out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"decode attention: no memory for {group} x {key.shape[2]} scores")


_OPENMP_LIBS = ("libgomp", "libiomp", "libomp")


def _one_openmp_runtime() -> bool:
    """Whether the process maps exactly one OpenMP runtime (read from ``/proc/self/maps``;
    False where it cannot be read). The kernel, loaded after torch, then shares torch's
    runtime (the loader resolves its ``libgomp.so.1`` to the one torch loaded), so a team
    it starts is torch's own; with two runtimes their threads would compete for the cores."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    names = {ln.split()[-1] for ln in lines if len(ln.split()) >= 6}
    return len({n for n in names if Path(n).name.startswith(_OPENMP_LIBS)}) == 1


def _cpuinfo() -> list[tuple[str, str]] | None:
    """The (field, value) lines of ``/proc/cpuinfo``, in order; None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in text.splitlines())]


def _cpu_field(name: str) -> str:
    """The first CPU's ``name`` line of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    return next((v for k, v in _cpuinfo() or () if k == name), "")


def _cpu_vendor() -> str:
    """The CPU's maker as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``;
    empty where it cannot be read)."""
    return _cpu_field("vendor_id")


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them (``amx_bf16``, ``avx512f``,
    ...; empty where it cannot be read)."""
    return frozenset(_cpu_field("flags").split())


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or platform.machine()
    keep = [f"{k}: {v}" for k, v in info if k in ("model name", "flags")]
    return "\n".join(dict.fromkeys(keep))


NATIVE_DIR_ENV = "BB_NATIVE_DIR"
"""Where compiled kernels are kept, when set."""


def _cache_dir() -> Path:
    """Where compiled kernels are kept: ``$BB_NATIVE_DIR``, default
    ``~/.cache/balance_beam/native`` (beside the probes' cache; a kernel is keyed by what
    it was built from, so any process on the machine may share it)."""
    env = os.environ.get(NATIVE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "balance_beam" / "native"


def _build(compiler: str, source_path: Path | None = None) -> Path:
    """The compiled library of ``source_path`` (default :data:`SOURCE`)'s path, compiling it
    unless already cached (written under a temporary name and renamed, so concurrent
    processes never load half a file)."""
    path = SOURCE if source_path is None else source_path
    source = path.read_bytes()
    flags = " ".join((*FLAGS, OPENMP)).encode()
    key = hashlib.sha256(
        b"\0".join([source, flags, compiler.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        try:
            _compile(compiler, path, (*FLAGS, OPENMP), (OPENMP,), obj, tmp)
        except subprocess.CalledProcessError:  # no OpenMP with this compiler: without it
            _compile(compiler, path, FLAGS, (), obj, tmp)
        os.replace(tmp, target)
    finally:
        for tmp_path in (tmp, obj):
            if os.path.exists(tmp_path):
                os.unlink(tmp_path)
    return target


def _compile(
    compiler: str, source: Path, flags: tuple[str, ...], link: tuple[str, ...], obj: str,
    out: str,
) -> None:  # fmt: skip
    """Compile ``source`` with ``flags`` into ``obj``, then link ``out`` with ``link``."""
    for command in ([compiler, *flags, "-c", "-o", obj, str(source)],
                    [compiler, "-shared", *link, "-o", out, obj, "-lm"]):  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def kernel() -> NativeAttention | None:
    """The compiled kernel, built on first call; None where ``BB_NATIVE=0``, where the
    machine's vectors hold fewer than :data:`MIN_LANES` floats, or where it cannot be built
    (a warning says why, once per process)."""
    return once(_loaded, _load)


def once(cache: dict[str, T | None], make: Callable[[str], T | None]) -> T | None:
    """``make(compiler)`` for the compiler ``$CC`` (else ``cc``), once per compiler and
    process (kept in ``cache``); None where ``BB_NATIVE=0``."""
    if os.environ.get("BB_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    with _lock:
        if compiler not in cache:
            cache[compiler] = make(compiler)
        return cache[compiler]


def load_library(source: Path, compiler: str, fallback: str) -> ctypes.CDLL | None:
    """``source`` compiled (:func:`_build`) and loaded with ``compiler``; None, with a
    warning that begins with ``fallback`` (what runs instead), where it does not build."""
    try:
        return ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warnings.warn(
            f"{fallback}: the C kernel did not build with {compiler!r}: {detail.strip()[:500]}",
            RuntimeWarning,
            stacklevel=5,
        )
        return None


def _load(compiler: str) -> NativeAttention | None:
    """Build and load the kernel with ``compiler``; None where the machine's vectors are
    narrower than :data:`MIN_LANES` floats, or with a warning where it cannot be built."""
    if shutil.which(compiler) is None:
        warnings.warn(
            f"decode attention runs torch's products: no C compiler {compiler!r} on PATH "
            "(install gcc or set CC)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    lib = load_library(SOURCE, compiler, "decode attention runs torch's products")
    if lib is None:
        return None
    lib.bb_decode_attention_lanes.restype = ctypes.c_int
    return NativeAttention(lib) if lib.bb_decode_attention_lanes() >= MIN_LANES else None
