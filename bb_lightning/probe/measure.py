"""Measure this machine's :class:`HardwareProfile` in a few seconds, cached per machine.

Probes, each given a share of ``max_seconds`` and sized to fit it:

- compute: best of repeated bf16 matrix products (1024² up to 4096² on the CPU,
  up to 8192² on CUDA), FLOP/s = ``2 n³ / seconds``;
- copy links: on CUDA, pinned host -> device and device -> host copies of a
  large buffer; on the CPU, where device and host tiers share RAM, the memcpy
  bandwidth of a large tensor copy stands for both (bytes/s);
- device memory: a copy within the device (RAM on the CPU), counted as its reads
  and writes together (``device_memory_bandwidth``, bytes/s);
- host memory: the rate decode attention on the host reads a KV cache at
  (``host_memory_bandwidth``, bytes/s; :mod:`bb_lightning.probe.host_memory`): the
  lesser of a sum over a host buffer with every core and the engine's CPU decode
  attention over a bf16 cache of the same bytes, whose skinny matrix products keep it
  below the plain read on a host of few cores;
- NVMe: write then read a few files (up to 384 MiB in all) under ``nvme_path``
  through :func:`storage.io.open_backend`, with ``fsync`` on write and a cold
  page cache on read (``O_DIRECT`` where the filesystem accepts it, else
  ``posix_fadvise(DONTNEED)``); capacity is the free space there; the compute seconds
  those transfers cost per byte moved (``nvme_cpu_seconds_per_byte``): the process's CPU
  seconds over them, and on a CPU device at least what a loop of matrix products loses
  beside reads and writes (on a virtual machine the hypervisor's emulation of the disk
  takes the cores' time too);
- optimizer: fused ``torch.optim.AdamW`` steps on 16 Mi fp32 host parameters
  (4 Mi when ``max_seconds`` < 8), 256 MiB of parameter, gradient and moments,
  more than a CPU cache holds; the median step, since the step shares host memory
  bandwidth with everything else (parameter updates/s); on the calling thread's
  intra-op team, as the training engine steps a CPU device's blocks.

Memory on the CPU: device and host tiers share RAM, so the device tier gets
:data:`CPU_DEVICE_SHARE` and the host tier :data:`CPU_HOST_SHARE` of the RAM
available now (the rest is left to the process and the OS); the fit search spends the
two budgets as one pool (``fit_search.pooled_budget``). On CUDA the device
tier gets :data:`CUDA_DEVICE_SHARE` of what this process can still allocate
(:func:`cuda_device_memory`: free memory once the allocator's cache is emptied,
within ``torch.cuda.set_per_process_memory_fraction``), read afresh also when
the profile comes from the cache, and the host tier :data:`HOST_SHARE` of the
available RAM.

The probes run in :data:`ROUNDS` interleaved rounds, each with its part of every
share, and each figure is the best over the rounds (the median AdamW step of each
round, then the best round). When the matrix-product or the disk rates of the rounds
disagree, or other processes took much of the CPU meanwhile (the checks of
:mod:`bb_lightning.probe.contention`), another round runs, up to
``contention.MAX_ROUNDS``; a profile still disturbed is returned with a warning and not
cached.

The result is cached as JSON in ``$BB_CACHE_DIR`` (default
``~/.cache/balance_beam``) under a name derived from the machine identity
(hostname, CPU model, GPU name, and the filesystem that holds the NVMe path: another
directory on the same filesystem reuses the profile, its free space read afresh). Its
NVMe read and write rates are measured again once older than :data:`NVME_MAX_AGE`
seconds (the disk probe alone, :data:`ROUNDS` rounds of its share): a disk's rate drifts
with its neighbours' load, a cloud volume's throttle and its fill.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

from bb_lightning.planner.profile import HardwareProfile
from bb_lightning.probe import contention
from bb_lightning.probe.contention import Timing
from bb_lightning.probe.host_memory import probe_host_attention, probe_host_read
from bb_lightning.probe.machine import (
    CACHE_ENV,
    PROBES_VERSION,
    cache_dir,
    cache_path,
    cores,
    cpu_model,
    cuda_device_memory,
    datasheet_peak,
    machine_identity,
    nvme_rates_age,
    read_cache,
    write_cache,
)
from storage.io import drop_cache
from storage.threads import limit_torch_threads

__all__ = [
    "CACHE_ENV",
    "CPU_DEVICE_SHARE",
    "CPU_HOST_SHARE",
    "CUDA_DEVICE_SHARE",
    "HOST_SHARE",
    "PROBES_VERSION",
    "cache_dir",
    "cache_path",
    "cuda_device_memory",
    "machine_identity",
    "measure",
]

CPU_DEVICE_SHARE = 0.25
"""Share of available RAM given to the device tier when the CPU is the device."""
CPU_HOST_SHARE = 0.60
"""Share of available RAM given to the host tier when the CPU is the device."""
CUDA_DEVICE_SHARE = 0.90
"""Share of free CUDA memory given to the device tier (the rest: workspaces, fragmentation)."""
HOST_SHARE = 0.80
"""Share of available RAM given to the host tier next to a CUDA device."""

_SHARES = {"flops": 0.25, "copy": 0.15, "nvme": 0.40, "adam": 0.20}
"""Share of ``max_seconds`` each probe may spend."""
_NVME_MAX_BYTES = 384 << 20
_NVME_MIN_BYTES = 16 << 20
_NVME_ASSUMED_RATE = 100e6
"""Bytes/s assumed when sizing the NVMe probe to its time share (a slow disk)."""
NVME_MAX_AGE = 600.0
"""Seconds a cached profile's NVMe read and write rates are reused before measure() probes
the disk again (the rest of the profile is kept)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe_flops(device: torch.device, seconds: float, timing: Timing = contention.SYSTEM) -> float:
    """Dense bf16 matrix-product FLOP/s: ``2 n³`` per product ``a @ b^T`` (the operand
    order of a linear layer: on a CPU without bf16 matrix instructions ``a @ b`` runs
    many times slower), best of repeats (timed under the label ``"matmul <n>"``)."""
    sizes = (2048, 4096, 8192) if device.type == "cuda" else (1024, 2048, 4096)
    best = 0.0
    deadline = time.perf_counter() + seconds
    for n in sizes:
        a = torch.randn(n, n, device=device).to(torch.bfloat16)
        b = torch.randn(n, n, device=device).to(torch.bfloat16)
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        torch.matmul(a, b.t(), out=out)  # warm-up
        _sync(device)

        def run(a: torch.Tensor = a, b: torch.Tensor = b, out: torch.Tensor = out) -> None:
            torch.matmul(a, b.t(), out=out)
            _sync(device)

        first = timing.seconds(f"matmul {n}", run)
        best = max(best, 2.0 * n**3 / max(first, 1e-9))
        left = deadline - time.perf_counter()
        best = max(best, contention.best_rate(2.0 * n**3, run, left / 2, 1, timing, f"matmul {n}"))
        if time.perf_counter() + 8 * first > deadline:
            break  # the next size costs 8x as much
    return best


def _probe_memory(
    device: torch.device, seconds: float, nbytes: int, timing: Timing = contention.SYSTEM
) -> float:
    """Bytes/s of device memory traffic (a copy within the device reads and writes
    ``nbytes`` each: twice ``nbytes`` per copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src)
        _sync(device)

    copy()  # fault the pages in
    return contention.best_rate(2.0 * nbytes, copy, seconds, 2, timing, "memory")


def _probe_copy(
    device: torch.device, seconds: float, nbytes: int, timing: Timing = contention.SYSTEM
) -> tuple[float, float]:
    """(host -> device, device -> host) bytes/s; on the CPU both are memcpy bandwidth."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def h2d() -> None:
            dev.copy_(host, non_blocking=True)
            _sync(device)

        def d2h() -> None:
            host.copy_(dev, non_blocking=True)
            _sync(device)

        h2d()
        d2h()
        return (
            contention.best_rate(nbytes, h2d, seconds / 2, 2, timing, "h2d"),
            contention.best_rate(nbytes, d2h, seconds / 2, 2, timing, "d2h"),
        )
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)

    def copy() -> None:
        dst.copy_(src)

    copy()  # fault the pages in
    rate = contention.best_rate(nbytes, copy, seconds, 2, timing, "copy")
    return rate, rate


def _probe_nvme(
    nvme_path: str,
    seconds: float,
    timing: Timing = contention.SYSTEM,
    *,
    beside: bool = False,
    cpu_clock: Callable[[], float] = time.process_time,
) -> tuple[float, float, int, float]:
    """(read bytes/s, write bytes/s, free bytes, compute seconds per byte moved) of the
    filesystem holding ``nvme_path``.

    The compute seconds per byte are at least the process's CPU time (user and system,
    every thread) over the writes and the reads, per byte written or read: the kernel's
    share of ``O_DIRECT`` transfers and the I/O threads', which on a CPU device come out
    of the compute's cores. With ``beside`` (a CPU device), also what a loop of matrix
    products loses beside reads and beside writes (:func:`_compute_lost_per_byte`), which
    includes the cores' time a hypervisor takes to emulate the disk: the larger of the two.
    ``cpu_clock``: the process's CPU seconds (user and system, every thread)."""
    from storage.io import IOFuture, mapped_empty, open_backend

    total = int(min(_NVME_MAX_BYTES, max(_NVME_MIN_BYTES, seconds * _NVME_ASSUMED_RATE)))
    files = 4
    per_file = (total // files) >> 20 << 20 or 1 << 20
    buffers = [mapped_empty(per_file) for _ in range(files)]  # as the store's arenas
    for i, buf in enumerate(buffers):
        buf.fill_(i + 1)
    with tempfile.TemporaryDirectory(prefix="bb-measure-", dir=nvme_path) as tmp:
        paths = [os.path.join(tmp, f"probe-{i}.bin") for i in range(files)]
        with open_backend() as backend:

            def all_files(op: Callable[[str, torch.Tensor, int], IOFuture], label: str) -> float:
                """Seconds to run ``op`` on every probe file at once, until all are done."""

                def run() -> None:
                    futures = [op(p, b, per_file) for p, b in zip(paths, buffers, strict=True)]
                    for future in futures:
                        future.wait()

                return timing.seconds(label, run)

            for p, b in zip(paths, buffers, strict=True):  # the files exist, as chunks do
                backend.write_async(p, b, per_file).wait()
            cpu = cpu_clock()
            write_s = all_files(_rewrite(backend), "nvme write")
            cpu = cpu_clock() - cpu
            for p in paths:
                drop_cache(p)
            cpu -= cpu_clock()
            read_s = all_files(backend.read_async, "nvme read")
            cpu += cpu_clock()
            if int(buffers[-1][0]) != files:
                raise AssertionError("NVMe probe read back other bytes than it wrote")
            lost = (
                _compute_lost_per_byte(backend, paths, buffers, per_file, seconds / 6)
                if beside
                else 0.0
            )
    moved = float(files * per_file)
    free = shutil.disk_usage(nvme_path).free
    per_byte = max(max(cpu, 0.0) / (2.0 * moved), lost)
    return moved / max(read_s, 1e-9), moved / max(write_s, 1e-9), int(free), per_byte


def _rewrite(backend: Any) -> Callable[[str, torch.Tensor, int], Any]:
    """A write as the store writes its scratch tensors (optimizer state, gradient sums,
    paged weights): over the existing file in place, without ``fsync``
    (:meth:`storage.nvme.NvmeTier.set_durable`)."""

    def write(path: str, src: torch.Tensor, nbytes: int) -> Any:
        return backend.write_async(path, src, nbytes, fsync=False, in_place=True)

    return write


BESIDE_MAX_LOOPS = 8
"""Loops of matrix products beside transfers at most while waiting for one to finish."""


def _loop_beside(
    backend: Any,
    paths: list[str],
    buffers: list[torch.Tensor],
    per_file: int,
    write: bool,
    loop: Callable[[], float],
    *,
    stop: threading.Event | None = None,
) -> tuple[float, int, int]:
    """(seconds, loops, bytes): ``loop()`` run beside reads (or writes) of ``paths``, again
    until at least one transfer has finished (a slow disk's first file may outlast a
    loop), at most :data:`BESIDE_MAX_LOOPS` times; the bytes whose transfer finished
    meanwhile. ``stop``: the event set once the loops are done, which ends the
    transfers (a new one if None)."""
    stop = threading.Event() if stop is None else stop
    moved = [0]

    def transfers() -> None:
        k = 0
        while not stop.is_set():
            i = k % len(paths)
            if write:
                _rewrite(backend)(paths[i], buffers[i], per_file).wait()
            else:
                backend.read_async(paths[i], buffers[i], per_file).wait()
            moved[0] += per_file
            k += 1

    worker = threading.Thread(target=transfers, name="bb-probe-io", daemon=True)
    worker.start()
    took, loops = 0.0, 0
    while loops < BESIDE_MAX_LOOPS and (loops == 0 or moved[0] == 0):
        took += loop()
        loops += 1
    done = moved[0]
    stop.set()
    worker.join()
    return took, loops, done


def _compute_lost_per_byte(
    backend: Any,
    paths: list[str],
    buffers: list[torch.Tensor],
    per_file: int,
    seconds: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds a loop of fp32 matrix products on the calling thread's team loses per byte
    the I/O backend moves beside it: the mean of the loss beside reads of ``paths`` and
    beside writes over them (in place, as the store writes its scratch tensors), against the fastest
    of two loops alone (:func:`_loop_beside`). 0.0 where no transfer finished in
    :data:`BESIDE_MAX_LOOPS` loops.

    On a CPU device the loss is the NVMe traffic's real cost to the compute: the kernel's
    share of the transfers and, on a virtual machine, the cores' time the hypervisor
    takes to emulate the disk (steal time, on no process's account): on a virtual machine
    the loops lost more time per byte than the process's own CPU time per byte, beside
    writes most (``bench/io_beside_compute.py``).
    ``clock``: the seconds the loops are timed by.
    """
    a = torch.randn(512, 512)
    out = torch.empty_like(a)

    def products(n: int) -> float:
        start = clock()
        for _ in range(n):
            torch.mm(a, a, out=out)
        return clock() - start

    n = max(4, int(seconds / max(products(8) / 8, 1e-9)))
    alone = products(n)
    beside = [
        _loop_beside(backend, paths, buffers, per_file, w, lambda: products(n))
        for w in (False, True)
    ]
    alone = min(alone, products(n))
    losses = [max(took - loops * alone, 0.0) / done for took, loops, done in beside if done > 0]
    return sum(losses) / len(losses) if len(losses) == 2 else 0.0


def _probe_adam(
    seconds: float, numel: int, timing: Timing = contention.SYSTEM, threads: int | None = None
) -> float:
    """Fused AdamW parameter updates/s on host fp32 parameters (4 tensors of ``numel/4``).

    ``threads``: the intra-op threads the updates run on (a thread of their own is started
    for them); None: the calling thread's. The training engine steps a CPU device's blocks
    on the compute's own thread and team (:class:`~bb_lightning.engine.grad_sink.GradSink`,
    ``inline``), so the probe takes the calling thread's: the fused kernel's rate grows
    with its threads, so one thread's rate would price the step too slow.
    """
    if threads is not None:
        with ThreadPoolExecutor(1, initializer=limit_torch_threads, initargs=(threads,)) as pool:
            return pool.submit(_probe_adam, seconds, numel, timing).result()
    params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        opt.step()
    except (RuntimeError, ValueError):  # fused kernel unavailable in this build
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        opt.step()
    count = sum(p.numel() for p in params)
    return contention.median_rate(float(count), opt.step, seconds, 3, timing, "adam")


ROUNDS = 2
"""Rounds of all probes ``measure()`` takes, each with ``1 / ROUNDS`` of every time share;
up to :data:`~bb_lightning.probe.contention.MAX_ROUNDS` while a check fails."""


def _probe_round(
    device: torch.device, nvme_path: str | None, max_seconds: float, timing: Timing
) -> dict[str, float]:
    """One pass of every probe, with ``1 / ROUNDS`` of each time share."""
    small = max_seconds < 8
    share = {k: max_seconds * v / ROUNDS for k, v in _SHARES.items()}
    copy_bytes = (64 << 20) if small else (256 << 20)
    out = {"flops": _probe_flops(device, share["flops"], timing)}
    out["h2d"], out["d2h"] = _probe_copy(device, share["copy"] * 0.75, copy_bytes, timing)
    out["memory"] = _probe_memory(device, share["copy"] * 0.15, copy_bytes, timing)
    # what host attention is priced on: a plain read of memory, or the engine's decode
    # attention where its arithmetic is the slower (the lesser of the two)
    out["host_read"] = min(
        probe_host_read(share["copy"] * 0.05, copy_bytes, timing),
        probe_host_attention(share["copy"] * 0.05, copy_bytes, timing),
    )
    if nvme_path:
        nvme = _probe_nvme(nvme_path, share["nvme"], timing, beside=device.type == "cpu")
        out["nvme_read"], out["nvme_write"], free, out["nvme_cpu"] = nvme
        out["nvme_free"] = float(free)
    # on the calling thread's team, as the training engine steps a CPU device (see _probe_adam)
    out["adam"] = _probe_adam(share["adam"], (4 << 20) if small else (16 << 20), timing)
    return out


def _probe_rounds(
    device: torch.device, nvme_path: str | None, max_seconds: float, timing: Timing
) -> tuple[dict[str, float], str | None]:
    """The best figure of each probe over interleaved rounds, and why not to trust them
    (one line) or None.

    Every probe runs once per round; after :data:`ROUNDS` rounds the checks of
    :mod:`~bb_lightning.probe.contention` run (the matrix-product and the disk rates
    reproduced within their spread, other processes' share of the CPU), and while one
    fails another round runs, up to ``contention.MAX_ROUNDS``.
    """
    rounds: list[dict[str, float]] = []
    share = timing.watch()
    while True:
        rounds.append(_probe_round(device, nvme_path, max_seconds, timing))
        if len(rounds) < ROUNDS:
            continue
        limits = {"flops": contention.SPREAD}
        if nvme_path:
            limits |= {"nvme_read": contention.DISK_SPREAD, "nvme_write": contention.DISK_SPREAD}
        spreads = {k: contention.spread([1 / max(r[k], 1e-30) for r in rounds]) for k in limits}
        unsteady = {k: s for k, s in spreads.items() if s > limits[k]}
        busy = share()
        if (not unsteady and busy <= contention.BUSY_SHARE) or len(rounds) >= contention.MAX_ROUNDS:
            break
    best = {k: max(r[k] for r in rounds) for k in rounds[0]}
    if nvme_path:
        best["nvme_free"] = rounds[-1]["nvme_free"]
        best["nvme_cpu"] = min(r["nvme_cpu"] for r in rounds)  # a cost: the least
    if not unsteady and busy <= contention.BUSY_SHARE:
        return best, None
    names = {"flops": "matrix-product", "nvme_read": "NVMe read", "nvme_write": "NVMe write"}
    parts = [
        f"{names[k]} rates differed {s:.1f} x between rounds (best "
        + ", ".join(f"{r[k] / (1e12 if k == 'flops' else 1e9):.3g}" for r in rounds)
        + (" TFLOP/s)" if k == "flops" else " GB/s)")
        for k, s in unsteady.items()
    ]
    if busy > contention.BUSY_SHARE:
        parts.append(f"other processes took {busy:.0%} of this process's cores")
    return best, (
        f"balance_beam: hardware probe unsteady over {len(rounds)} rounds: {'; '.join(parts)}; "
        "another process is using the CPU or disk: planning with the best figures, not caching "
        "them (measured again next time)"
    )


def _measure_now(
    nvme_path: str | None,
    max_seconds: float,
    timing: Timing = contention.SYSTEM,
    notes: list[str] | None = None,
) -> HardwareProfile:
    """The profile measured now; why not to trust it is appended to ``notes``."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    best, note = _probe_rounds(device, nvme_path, max_seconds, timing)
    if note is not None and notes is not None:
        notes.append(note)
    flops, h2d, d2h, memory_bw, adam = (best[k] for k in ("flops", "h2d", "d2h", "memory", "adam"))
    if nvme_path:
        nvme_read, nvme_write = best["nvme_read"], best["nvme_write"]
        nvme_free, nvme_cpu = int(best["nvme_free"]), best["nvme_cpu"]
    else:
        nvme_read, nvme_write, nvme_free, nvme_cpu = 0.0, 0.0, 0, 0.0
    available = psutil.virtual_memory().available
    if cuda:
        device_memory = int(cuda_device_memory(device) * CUDA_DEVICE_SHARE)
        host_memory = int(available * HOST_SHARE)
        name = f"measured: {torch.cuda.get_device_name(device)} / {cpu_model()}"
    else:
        device_memory = int(available * CPU_DEVICE_SHARE)
        host_memory = int(available * CPU_HOST_SHARE)
        name = f"measured: {cpu_model()}"
    return HardwareProfile(
        name=name,
        device_type=device.type,
        device_memory=device_memory,
        device_flops=flops,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        host_memory=host_memory,
        nvme_read_bandwidth=nvme_read,
        nvme_write_bandwidth=nvme_write,
        nvme_capacity=nvme_free,
        nvme_cpu_seconds_per_byte=nvme_cpu,
        host_adam_params_per_s=adam,
        cores=cores(),
        device_memory_bandwidth=memory_bw,
        host_memory_bandwidth=best.get("host_read", 0.0),
        peak_flops=datasheet_peak(device),
    )


def measure(
    *,
    nvme_path: str | None = None,
    cache: bool = True,
    max_seconds: float = 20.0,
    timing: Timing | None = None,
) -> HardwareProfile:
    """Measure this machine's profile in about ``max_seconds`` seconds (see the module doc).

    ``nvme_path`` is a directory on the disk that will hold the NVMe tier; ``None``
    leaves the NVMe fields at 0. With ``cache`` a profile measured before for the
    same machine identity is returned without measuring (but for its NVMe rates once
    older than :data:`NVME_MAX_AGE` seconds, probed again); ``cache=False`` measures
    afresh (and refreshes the cache). A measurement disturbed by other processes
    (see :func:`_probe_rounds`; up to 1.5 x ``max_seconds``) is returned with a
    warning and not cached. ``timing`` times the passes (default: the real clock,
    :data:`~bb_lightning.probe.contention.SYSTEM`).
    """
    if not max_seconds > 0:
        raise ValueError(f"max_seconds = {max_seconds} must be > 0: pass e.g. 20.0 seconds")
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise ValueError(
            f"nvme_path {nvme_path!r} is not a directory: create it or pass None for no NVMe tier"
        )
    identity = machine_identity(nvme_path)
    path = cache_path(identity)
    if cache:
        cached = read_cache(path, identity)
        if cached is not None and nvme_path is not None:  # this directory's free space of now
            cached = cached.replace(nvme_capacity=shutil.disk_usage(nvme_path).free)
            cached = _disk_of_now(cached, path, identity, nvme_path, max_seconds, timing)
        if cached is not None and cached.device_type == "cuda":  # the free memory of now
            device = torch.device("cuda", torch.cuda.current_device())
            return cached.replace(device_memory=int(cuda_device_memory(device) * CUDA_DEVICE_SHARE))
        if cached is not None:
            return cached
    notes: list[str] = []
    profile = _measure_now(nvme_path, max_seconds, timing or contention.SYSTEM, notes)
    if notes:
        warnings.warn(notes[0], RuntimeWarning, stacklevel=2)
        return profile
    write_cache(path, identity, profile)
    return profile


def _disk_of_now(
    cached: HardwareProfile,
    path: Path,
    identity: dict[str, str],
    nvme_path: str,
    max_seconds: float,
    timing: Timing | None,
) -> HardwareProfile:
    """``cached`` with the NVMe read and write rates of now where the cache's are older than
    :data:`NVME_MAX_AGE` (or of unknown age): the best of :data:`ROUNDS` disk probes, each
    with a round's share of ``max_seconds``, cached again."""
    if nvme_rates_age(path) <= NVME_MAX_AGE:
        return cached
    seconds = max_seconds * _SHARES["nvme"] / ROUNDS
    timing = timing or contention.SYSTEM
    rates = [_probe_nvme(nvme_path, seconds, timing)[:2] for _ in range(ROUNDS)]
    fresh = cached.replace(
        nvme_read_bandwidth=max(r for r, _ in rates), nvme_write_bandwidth=max(w for _, w in rates)
    )
    write_cache(path, identity, fresh)
    return fresh
