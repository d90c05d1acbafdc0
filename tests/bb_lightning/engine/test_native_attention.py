"""The compiled decode attention kernel against attention written out in float64, over the
shapes its vector paths split on (query heads per key/value head, head widths that are or
are not multiples of its vectors, positions that do or do not fill its blocks), and its
fallback to torch's products where it cannot be built."""

from __future__ import annotations

import math
import platform
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from bb_lightning.engine import attention, native
from bb_lightning.engine.attention import decode_attention


def _reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """softmax(q·Kᵀ·scale, masked)·V in float64; q ``[b, kv_heads, group, d]``."""
    s = torch.einsum("bhgd,bhld->bhgl", q.double(), k.double()) * scale
    s = s.masked_fill(~keep, -math.inf)
    return torch.einsum("bhgl,bhld->bhgd", s.softmax(-1), v.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("dim", "vdim"), [(64, 64), (72, 40), (80, 80), (128, 96), (64, 576)])
def test_the_kernel_equals_a_float64_reference(
    kernel: native.NativeAttention, dtype: torch.dtype, group: int, dim: int, vdim: int
) -> None:
    kern = kernel
    g = torch.Generator().manual_seed(group * dim)
    b, kv_heads, length = 3, 2, 160
    # one position, a pair, past whole blocks with tails; past the values' blocks of positions
    for kv_len in (1, 2, 17, 37, 157):
        q = torch.randn(b, kv_heads, group, dim, generator=g).to(dtype).float()
        # a cache with room beyond the written positions: rows apart by their stride
        k = torch.randn(b, kv_heads, length, dim, generator=g).to(dtype)[:, :, :kv_len]
        v = torch.randn(b, kv_heads, length, vdim, generator=g).to(dtype)[:, :, :kv_len]
        keep = torch.ones(b, 1, 1, kv_len, dtype=torch.bool)
        keep[1, ..., : kv_len // 3] = False  # a left-padded prompt
        bias = kern.additive_mask(keep, (b, kv_heads, group, kv_len))
        out = torch.full((b, kv_heads, group, vdim), math.nan)
        kern.attend(q, k, v, bias, dim**-0.5, out, slice(None), slice(None))
        ref = _reference(q, k, v, keep.expand(b, kv_heads, group, kv_len), dim**-0.5)
        # bf16: the weights are rounded to bf16 before their products with the values
        tol = 2e-6 if dtype == torch.float32 else 1.5e-2
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize(("group", "dim"), [(4, 64), (8, 128)])
def test_four_head_key_products_of_either_width_equal_a_float64_reference(
    kernel: native.NativeAttention, wide: bool, group: int, dim: int
) -> None:
    """The products of four query heads' keys in 256-bit or 512-bit vectors (each CPU maker
    gets one at load), bf16, positions past whole blocks of eight and a tail."""
    g = torch.Generator().manual_seed(group + dim)
    b, kv_heads, kv_len = 2, 3, 45
    q = torch.randn(b, kv_heads, group, dim, generator=g).bfloat16().float()
    k = torch.randn(b, kv_heads, kv_len, dim, generator=g).bfloat16()
    v = torch.randn(b, kv_heads, kv_len, dim, generator=g).bfloat16()
    keep = torch.ones(b, kv_heads, group, kv_len, dtype=torch.bool)
    out = torch.full((b, kv_heads, group, dim), math.nan)
    if kernel.set_wide(wide) != wide:
        pytest.skip("the kernel has no bf16 pair products on this CPU")
    try:
        kernel.attend(q, k, v, None, dim**-0.5, out, slice(None), slice(None))
    finally:
        kernel.set_wide(native._cpu_vendor() == "GenuineIntel")
    ref = _reference(q, k, v, keep, dim**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize(
    ("group", "dim", "vdim", "per_head_mask"),
    [
        (4, 128, 128, False), (8, 64, 96, True), (16, 32, 64, False), (4, 96, 32, True),
        (1, 128, 128, False), (2, 64, 64, True),
    ],
)  # fmt: skip
def test_heads_on_the_matrix_tiles_equal_a_float64_reference(
    kernel: native.NativeAttention, group: int, dim: int, vdim: int, per_head_mask: bool
) -> None:
    """bf16 heads on the matrix tiles (where the CPU has them): positions in blocks of 32,
    of 16 and a tail of rows, one position, a padding mask shared by the group's query heads
    or one of each head's own; against float64, and against the vector products' output
    (the kernel with the tiles off) as close as two bf16 roundings of the weights allow."""
    if not kernel.set_tiles(True):
        pytest.skip("no matrix tiles on this CPU")
    assert kernel.on_tiles(group, 300, dim, vdim, torch.bfloat16)
    assert not kernel.on_tiles(group, 300, dim, vdim, torch.float32)
    assert not kernel.on_tiles(3, 300, dim, vdim, torch.bfloat16)  # 3 does not divide 16
    assert not kernel.on_tiles(group, 300, dim + 8, vdim, torch.bfloat16)
    # one or two query heads a key/value head take the tiles from 288 positions on
    assert kernel.on_tiles(group, 287, dim, vdim, torch.bfloat16) is (group >= 4)
    g = torch.Generator().manual_seed(group * dim + vdim)
    b, kv_heads = 2, 2
    try:
        for kv_len in (1, 15, 16, 47, 64, 81, 300) if group >= 4 else (288, 300, 333):
            q = torch.randn(b, kv_heads, group, dim, generator=g).bfloat16().float() * 2
            # keys and values with room for more positions: rows apart by their stride
            k = torch.randn(b, kv_heads, kv_len + 5, dim, generator=g).bfloat16()[:, :, :kv_len]
            v = torch.randn(b, kv_heads, kv_len + 5, vdim, generator=g).bfloat16()[:, :, :kv_len]
            keep = torch.ones(b, kv_heads if per_head_mask else 1, group if per_head_mask else 1,
                              kv_len, dtype=torch.bool)  # fmt: skip
            keep[1, ..., : kv_len // 3] = False  # a left-padded prompt
            if per_head_mask and kv_len > 4:
                keep[0, 1, 1::2, kv_len // 2 :] = False  # every other query head its own
            bias = kernel.additive_mask(keep, (b, kv_heads, group, kv_len))
            outs = []
            for tiles in (True, False):
                kernel.set_tiles(tiles)
                out = torch.full((b, kv_heads, group, vdim), math.nan)
                kernel.attend(q, k, v, bias, dim**-0.5, out, slice(None), slice(None))
                outs.append(out)
            ref = _reference(q, k, v, keep.expand(b, kv_heads, group, kv_len), dim**-0.5)
            torch.testing.assert_close(outs[0].double(), ref, atol=1.5e-2, rtol=1.5e-2)
            torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)
            # the tiles' error against float64 no larger than the vector products' and a bit
            err = [float((o.double() - ref).abs().max()) for o in outs]
            assert err[0] <= 1.25 * err[1] + 1e-6, (kv_len, err)
    finally:
        kernel.set_tiles(True)


@pytest.mark.parametrize("tiles", [True, False])
def test_a_masked_position_weighs_nothing_and_a_nan_score_stays_nan(
    kernel: native.NativeAttention, tiles: bool
) -> None:
    """bf16, four query heads over 64 positions, on the tiles and with the vector products:
    values near bf16's largest at masked positions leave the output as the float64 reference
    gives it (their weight is exactly 0), and a NaN in one query head's row makes that head's
    output NaN and no other's."""
    if kernel.set_tiles(tiles) != tiles:
        pytest.skip("no matrix tiles on this CPU")
    try:
        g = torch.Generator().manual_seed(7)
        b, kv_heads, group, dim, kv_len = 2, 2, 4, 64, 64
        q = torch.randn(b, kv_heads, group, dim, generator=g).bfloat16().float()
        k = torch.randn(b, kv_heads, kv_len, dim, generator=g).bfloat16()
        v = torch.randn(b, kv_heads, kv_len, dim, generator=g).bfloat16()
        keep = torch.ones(b, 1, 1, kv_len, dtype=torch.bool)
        keep[1, ..., :40] = False
        v[1, :, :40] = 3e38  # masked: a weight of 1e-38 would show
        # one live position outweighs the rest (the weights' sum near 1, where a masked
        # position's 1e-38 stays a normal bf16 and is not flushed as a subnormal)
        q[1] = q[1, :, :1]
        k[1, :, 63] = (q[1, :, 0] * 3).bfloat16()
        bias = kernel.additive_mask(keep, (b, kv_heads, group, kv_len))
        out = torch.full((b, kv_heads, group, dim), math.nan)
        kernel.attend(q, k, v, bias, dim**-0.5, out, slice(None), slice(None))
        ref = _reference(q, k, v, keep.expand(b, kv_heads, group, kv_len), dim**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=1.5e-2, rtol=1.5e-2)
        q[0, 1, 2, 5] = math.nan
        kernel.attend(q, k, v, None, dim**-0.5, out, slice(None), slice(None))
        nan = out.isnan().all(-1)
        assert nan[0, 1, 2] and nan.sum() == 1 and not out[~nan].isnan().any()
    finally:
        kernel.set_tiles(True)


def test_loading_the_kernel_leaves_subnormal_floats_alone(kernel: native.NativeAttention) -> None:
    # a library linked with -ffast-math sets flush-to-zero for the whole process on load
    tiny = 5e-324  # the least subnormal double
    assert tiny * 1.0 == tiny and tiny > 0.0
    assert float(torch.tensor([1e-40]).mul(1.0)) > 0.0  # a subnormal float32


def test_a_range_writes_only_its_sequences_and_heads(kernel: native.NativeAttention) -> None:
    kern = kernel
    q = torch.randn(4, 3, 2, 64)
    k, v = torch.randn(4, 3, 9, 64), torch.randn(4, 3, 9, 64)
    out = torch.full((4, 3, 2, 64), math.nan)
    kern.attend(q, k, v, None, 0.125, out, slice(1, 3), slice(1, 2))
    written = torch.zeros(4, 3, dtype=torch.bool)
    written[1:3, 1:2] = True
    assert out[~written].isnan().all()
    assert not out[written].isnan().any()
    keep = torch.ones(2, 1, 2, 9, dtype=torch.bool)
    ref = _reference(q[1:3, 1:2], k[1:3, 1:2], v[1:3, 1:2], keep, 0.125)
    torch.testing.assert_close(out[1:3, 1:2].double(), ref, atol=2e-6, rtol=2e-6)


def test_without_a_compiler_decode_attention_runs_torch_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CC", "bb-no-such-compiler")
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.warns(RuntimeWarning, match="no C compiler 'bb-no-such-compiler'"):
        assert native.kernel() is None
    calls: list[int] = []
    attend = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    q = torch.randn(2, 4, 1, 32)
    k, v = torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32)
    with torch.inference_mode():
        got, _ = decode_attention(nn.Module(), q, k, v, None)
    assert calls == [1]
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    ref = _reference(q.reshape(2, 2, 2, 32), k, v, keep, 32**-0.5)
    torch.testing.assert_close(got.reshape(2, 2, 2, 32).double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="builds the kernel for x86-64 AVX2"
)
def test_a_kernel_built_for_avx2_vectors_leaves_decode_attention_to_torch_products(
    kernel: native.NativeAttention, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # on an AVX-512 machine with a compiler: the same source built as for an AVX2 one
    monkeypatch.setenv(native.NATIVE_DIR_ENV, str(tmp_path))
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native.FLAGS)
    monkeypatch.setattr(native, "FLAGS", flags)
    monkeypatch.setattr(native, "_loaded", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # narrow vectors are no failure: nothing to warn about
        assert native.kernel() is None
    assert len(list(tmp_path.glob("decode_attention-*.so"))) == 1  # it built, and is not used
    calls: list[int] = []
    attend = attention._attend

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention, "_attend", counted)
    q = torch.randn(2, 8, 1, 64)
    k, v = torch.randn(2, 2, 7, 64), torch.randn(2, 2, 7, 64)
    with torch.inference_mode():
        got, _ = decode_attention(nn.Module(), q, k, v, None)
    assert calls == [1]  # torch's products ran it
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    ref = _reference(q.reshape(2, 2, 4, 64), k, v, keep, 64**-0.5)
    torch.testing.assert_close(got.reshape(2, 2, 4, 64).double(), ref, atol=2e-6, rtol=2e-6)


def test_bb_native_0_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BB_NATIVE", "0")
    assert native.kernel() is None


def test_a_broken_build_warns_with_the_compiler_s_message(
    kernel: native.NativeAttention, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # the compiler the kernel builds with (skipped without one) rejects a broken source
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    monkeypatch.setenv(native.NATIVE_DIR_ENV, str(tmp_path / "native"))
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.warns(RuntimeWarning, match="did not build"):
        assert native.kernel() is None
    assert list((tmp_path / "native").iterdir()) == []  # no half-written library


def test_the_kernel_shares_torch_s_openmp_runtime(kernel: native.NativeAttention) -> None:
    """Built with OpenMP, the kernel is loaded against the runtime torch already holds (one
    runtime in the process, torch's own), so the team it starts is torch's intra-op team."""
    maps = Path("/proc/self/maps")
    if not maps.exists() or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("needs /proc and torch on OpenMP")
    assert kernel.team
    runtimes = {ln.split()[-1] for ln in maps.read_text().splitlines() if "libgomp" in ln}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert len(runtimes) == 1, runtimes
    if any(torch_lib.glob("libgomp*")):  # a wheel that bundles it: the kernel uses that one
        assert Path(runtimes.pop()).parent == torch_lib


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "group"), [(1, 1), (3, 4), (37, 2)])
def test_a_step_on_torch_s_thread_team_equals_a_float64_reference(
    kernel: native.NativeAttention, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
    batch: int, group: int,
) -> None:  # fmt: skip
    """On two intra-op threads a decode step runs as one call of the kernel on the calling
    thread's team (pieces of a few heads each, fewer heads than pieces or many more), over
    ragged prompts in a cache cut after its written positions."""
    if not kernel.team:
        pytest.skip("the kernel was built without OpenMP")
    calls: list[str] = []
    team = native.NativeAttention.attend_team

    def recorded(self: native.NativeAttention, *args: Any) -> None:
        calls.append(threading.current_thread().name)
        team(self, *args)

    monkeypatch.setattr(native.NativeAttention, "attend_team", recorded)
    g = torch.Generator().manual_seed(batch * group)
    kv_heads, length, written, dim = 3, 40, 29, 64
    q = torch.randn(batch, kv_heads * group, 1, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    k[:, :, written:] = v[:, :, written:] = math.nan  # never to be read
    keep = torch.arange(length).expand(batch, length) < written
    for row in range(batch):
        keep[row, : row % 7] = False  # ragged left padding
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got, _ = decode_attention(nn.Module(), q, k, v, keep[:, None, None, :])
    finally:
        torch.set_num_threads(threads)
    assert calls == [threading.current_thread().name]
    grouped = q.float().reshape(batch, kv_heads, group, dim)
    full = keep[:, None, None, :written].expand(batch, kv_heads, group, written)
    ref = _reference(grouped, k[:, :, :written], v[:, :, :written], full, dim**-0.5)
    tol = 2e-6 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got.reshape(batch, kv_heads, group, dim).double(), ref,
                               atol=tol, rtol=tol)  # fmt: skip


def test_a_compiler_without_openmp_builds_the_kernel_for_the_pool(
    kernel: native.NativeAttention, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # the compiler rejects the OpenMP flag: the kernel builds without it
    monkeypatch.setenv(native.NATIVE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(native, "OPENMP", "-fbb-no-such-flag")
    monkeypatch.setattr(native, "_loaded", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no OpenMP is no failure: nothing to warn about
        kern = native.kernel()
    assert kern is not None and not kern.team
    q, k, v = torch.randn(5, 2, 4, 64), torch.randn(5, 2, 9, 64), torch.randn(5, 2, 9, 64)
    out = torch.full((5, 2, 4, 64), math.nan)
    kern.attend_team(q, k, v, None, 0.125, out, 2)  # on the calling thread alone
    keep = torch.ones(5, 2, 4, 9, dtype=torch.bool)
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, 0.125), atol=2e-6, rtol=2e-6)
