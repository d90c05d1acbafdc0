"""Decode attention on the host over a KV cache: bytes read per second, against a plain
read of the same bytes and the planner's price for it.

For each size (concurrent sequences x cached positions) it builds one layer's KV cache
(``[seqs, kv_heads, positions, head_dim]`` keys and values, ``--dtype``) and times the
engine's CPU decode attention (:func:`bb_lightning.engine.attention.decode_attention`, one
query token per sequence, in inference mode as the engine decodes; the compiled kernel where
it builds, and beside it torch's products, ``BB_NATIVE=0``, and where the kernel runs the
layer on the CPU's matrix tiles, its vector products with the tiles off) and a plain read of the
same keys and values (``torch.sum`` over each) in turns, one of each per round, best of
each within twice ``--seconds``: a neighbour's load slows both alike, so their ratio holds
on a shared machine. It prints the cache's bytes over each time (GB/s), their ratio, and
the planner's predicted seconds
(:func:`bb_lightning.planner.host_attention.host_attention_seconds`) on the rate the
hardware probe prices host attention at, measured in the same run: the lesser of its plain
read of host memory (:func:`bb_lightning.probe.host_memory.probe_host_read`) and its decode
attention probe (:func:`bb_lightning.probe.host_memory.probe_host_attention`, here over a
cache of this layer's shape and ``--dtype``, 256 MiB at 512 positions), with measured /
predicted: whether a rate measured at one size prices the others. The first size's output
is checked against torch's ``scaled_dot_product_attention``. Before the sizes it prints the
rate decode attention reaches with every byte in the CPU's caches (every sequence and head a
view of the same rows): where that is near the plain read, the layer's products, not the
memory, bound it.

Sizes whose cache exceeds ``--max-gib`` are skipped (the issue's 1024 sequences x 2048
positions of an 8 x 128 GQA layer in bf16 is 8 GiB).

Run: ``.venv/bin/python bench/host_attention.py [--seqs 64,256,1024] [--positions 512,2048]``
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial

import _common
import torch
from torch import nn

from bb_lightning.engine import native
from bb_lightning.engine.attention import decode_attention
from bb_lightning.planner.host_attention import host_attention_seconds
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.probe.host_memory import probe_host_attention, probe_host_read
from storage.io import mapped_zeros

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _read(*tensors: torch.Tensor) -> None:
    """A plain read of ``tensors``: a sum over each."""
    for t in tensors:
        torch.sum(t)


def _vector_products(
    kernel: native.NativeAttention, module: nn.Module, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> None:  # fmt: skip
    """Decode attention through the compiled kernel with the matrix tiles off."""
    kernel.set_tiles(False)
    try:
        decode_attention(module, q, k, v, None)
    finally:
        kernel.set_tiles(True)


def _torch_products(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Decode attention with torch's products instead of the compiled kernel."""
    os.environ["BB_NATIVE"] = "0"
    try:
        decode_attention(module, q, k, v, None)
    finally:
        del os.environ["BB_NATIVE"]


def _profile(heads: int, kv_heads: int, dim: int) -> ModelProfile:
    """One attention layer's shape as the planner sees it (a single block)."""
    return ModelProfile(
        name="attention layer", num_blocks=1, hidden_size=heads * dim, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=dim, vocab_size=1, max_positions=0, block_params=0,
        block_matmul_params=0, embed_params=0, head_params=0, final_params=0,
        tied_embeddings=False, act_bytes_per_token_checkpointed=0, act_bytes_per_token_full=0,
        kv_bytes_per_token=2 * kv_heads * dim * 2,
    )  # fmt: skip


def _host(bandwidth: float) -> HardwareProfile:
    """This host as a profile priced on the probe's rate for host attention (the rest
    unused)."""
    return HardwareProfile(
        name="this host", device_type="cpu", device_memory=0, device_flops=1.0,
        h2d_bandwidth=1.0, d2h_bandwidth=1.0, host_memory=0, nvme_read_bandwidth=0.0,
        nvme_write_bandwidth=0.0, nvme_capacity=0, host_adam_params_per_s=1.0, cores=1,
        host_memory_bandwidth=bandwidth,
    )  # fmt: skip


def _in_cache_rate(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seconds: float, positions: int = 512
) -> tuple[float, int]:
    """(bytes/s, bytes in memory) of decode attention over a cache of this layer's shape
    whose every sequence and key/value head is a view of the same ``positions`` rows (stride
    0), 256 MiB as counted: the rate the arithmetic allows when every byte comes from the
    CPU's caches. A layer whose rate here is near a plain read of memory cannot stream its
    cache at that read's rate: its products, not the memory, bound it."""
    elem = torch.empty((), dtype=dtype).element_size()
    seqs = max(1, (256 << 20) // (2 * kv_heads * positions * dim * elem))
    k = torch.randn(1, 1, positions, dim, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(seqs, heads, 1, dim, dtype=dtype)
    shape = (seqs, kv_heads, positions, dim)
    run = partial(decode_attention, nn.Module(), q, k.expand(shape), v.expand(shape), None)
    with torch.inference_mode():
        best = _common.best_seconds({"attend": run}, seconds)
    return 2 * seqs * kv_heads * positions * dim * elem / best["attend"], 2 * k.nbytes


def _check_against_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Largest absolute difference of decode attention's output from torch's sdpa (fp32)."""
    ours, _ = decode_attention(nn.Module(), q, k, v, None)
    group = q.shape[1] // k.shape[1]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    )
    return float((ours.float() - ref.transpose(1, 2)).abs().max())


def main() -> None:
    """Print one line per size: GB/s of attention and of a plain read, predicted seconds."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", default="64,256,1024", help="concurrent sequences, comma-separated")
    ap.add_argument("--positions", default="512,2048", help="cached positions, comma-separated")
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    ap.add_argument("--head-dim", type=int, default=128, help="elements per head")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing budget per size, s")
    ap.add_argument("--max-gib", type=float, default=4.0, help="largest cache to build, GiB")
    args = ap.parse_args()
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}: fix one")
    dtype = DTYPES[args.dtype]
    print(_common.machine(None))
    kernel = native.kernel()
    group = args.heads // args.kv_heads
    print(
        "decode attention: the compiled kernel, beside torch's products (and its vector "
        "products, the matrix tiles off, at the sizes it runs on the tiles)"
        if kernel is not None
        else "decode attention: torch's products (the compiled kernel did not build)"
    )
    probe_bytes = 256 << 20
    seconds = args.seconds  # best of repeats, as long as a size's: alike on a shared machine
    read_rate = probe_host_read(seconds, probe_bytes)
    print(f"probe: host memory read {read_rate / 1e9:.3f} GB/s (sum over {probe_bytes >> 20} MiB)")
    layer = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    attention = probe_host_attention(seconds, probe_bytes, dtype=dtype, **layer)
    bandwidth = min(read_rate, attention)
    print(
        f"probe: host decode attention {attention / 1e9:.3f} GB/s ({probe_bytes >> 20} MiB "
        f"{args.dtype} cache, 512 positions); priced at {bandwidth / 1e9:.3f} GB/s (the lesser)"
    )
    ceiling, small = _in_cache_rate(args.heads, args.kv_heads, args.head_dim, dtype, seconds)
    print(
        f"in the CPU's caches: decode attention {ceiling / 1e9:.3f} GB/s, every sequence and "
        f"head of this layer reading the same {small / 2**10:.0f} KiB ({ceiling / read_rate:.2f} x the probe's "
        f"read of memory): the rate its arithmetic allows, at most what it reaches from memory"
    )
    profile, host = _profile(args.heads, args.kv_heads, args.head_dim), _host(bandwidth)
    elem = torch.empty((), dtype=dtype).element_size()
    checked = False
    for seqs in (int(s) for s in args.seqs.split(",")):
        for pos in (int(p) for p in args.positions.split(",")):
            shape = (seqs, args.kv_heads, pos, args.head_dim)
            nbytes = 2 * seqs * args.kv_heads * pos * args.head_dim * elem
            if nbytes > args.max_gib * (1 << 30):
                print(f"{seqs} seqs x {pos} positions: skipped ({nbytes / 2**30:.2f} GiB cache)")
                continue
            # allocated as the engine's host cache is (huge pages where the kernel gives them)
            k, v = (mapped_zeros(shape, dtype).copy_(torch.randn(shape, dtype=dtype)) for _ in "kv")
            q = torch.randn(seqs, args.heads, 1, args.head_dim, dtype=dtype)
            if not checked:
                err = _check_against_sdpa(q, k, v)
                print(f"check: decode attention vs torch sdpa (fp32), max abs diff {err:.3g}")
                checked = True
            module = nn.Module()
            runs: dict[str, Callable[[], object]] = {
                "attend": partial(decode_attention, module, q, k, v, None),
                "read": partial(_read, k, v),
            }
            if kernel is not None:
                runs["torch"] = partial(_torch_products, module, q, k, v)
            tiles = kernel is not None and kernel.on_tiles(
                group, pos, args.head_dim, args.head_dim, dtype
            )
            if tiles:
                runs["vectors"] = partial(_vector_products, kernel, module, q, k, v)
            with torch.inference_mode():  # as the engine decodes
                best = _common.best_seconds(runs, 2 * args.seconds)
            attend, read = best["attend"], best["read"]
            beside = ""
            if kernel is not None:
                beside = f"torch's products {nbytes / best['torch'] / 1e9:.3f} GB/s"
                if tiles:
                    beside = f"vector products {nbytes / best['vectors'] / 1e9:.3f} GB/s, {beside}"
                beside = f" ({beside})"
            predicted = host_attention_seconds(profile, host, seqs, pos - 1, elem)
            print(
                f"{seqs} seqs x {pos} positions ({nbytes / 2**20:.1f} MiB): attention "
                f"{nbytes / attend / 1e9:.3f} GB/s{beside}, plain read {nbytes / read / 1e9:.3f} GB/s, "
                f"attention / read = {read / attend:.3f}; predicted {predicted * 1e3:.4g} ms, "
                f"measured {attend * 1e3:.4g} ms, measured / predicted = {attend / predicted:.3f}"
            )
            del k, v, q


if __name__ == "__main__":
    main()
