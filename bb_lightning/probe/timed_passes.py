"""Timing a probe's passes beside a reference matrix product, with the checks and the
fallbacks of :mod:`bb_lightning.probe.calibrate`'s module doc: rounds of passes until
they are steady and the products beside them run at the profile's rate
(:func:`timed_rounds`), else the passes timed on a quiet core (:func:`alone_on_core`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bb_lightning.planner.profile import HardwareProfile
from bb_lightning.probe import contention
from bb_lightning.probe.contention import Timing

__all__ = ["Ceiling", "Passes", "alone_on_core", "reference_size", "sync", "timed_rounds"]

Ceiling = Callable[[torch.dtype, torch.device], float]
"""The highest efficiency a model computing in a dtype on a device may be credited with
(:func:`~bb_lightning.probe.calibrate.dtype_ceiling`)."""


REFERENCE_SIZE = {"cpu": 2048, "cuda": 4096}
"""Largest side of the square bf16 matrix product timed between the model's passes, per
device type: large enough to run at the hardware probe's best rate when nothing else runs
(on a CPU with AMX a 1024-square product falls well short of the rate of a 2048-square
one, which the drift check would take for a busy neighbour), small enough to repeat
cheaply (17 GFLOP, a few hundredths of a second on such a CPU). A device whose profile
rate would take longer than :data:`REFERENCE_SECONDS` gets a smaller one
(:func:`reference_size`)."""


REFERENCE_SECONDS = 0.05
"""Longest a reference product may take at the hardware profile's rate, seconds."""


MIN_REFERENCE_SIZE = 256
"""Smallest side of the reference product."""


def reference_size(device_type: str, device_flops: float) -> int:
    """Side of the reference product: :data:`REFERENCE_SIZE`, or the largest multiple of
    256 whose ``2 n^3`` FLOPs take at most :data:`REFERENCE_SECONDS` at ``device_flops``
    (FLOP/s), at least :data:`MIN_REFERENCE_SIZE`. A CPU without bf16 matrix instructions
    (AVX2 only) multiplies bf16 so slowly that it would spend about a second on each
    2048-square product."""
    largest = REFERENCE_SIZE.get(device_type, REFERENCE_SIZE["cpu"])
    fits = (max(device_flops, 1.0) * REFERENCE_SECONDS / 2.0) ** (1.0 / 3.0)
    return int(min(largest, max(MIN_REFERENCE_SIZE, fits // 256 * 256)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Passes:
    """The fastest pass of each series over the rounds a probe took."""

    best: dict[str, float]
    """Fastest seconds per series label."""
    reference_flops: float
    """FLOP/s of the median matrix product timed between the model's passes."""
    note: str | None
    """Why not to trust them (one line), or None."""
    drifted: bool = False
    """Whether the passes' rates are to be taken relative to :attr:`reference_flops`, not
    the profile's: the matrix products stayed below ``DRIFT`` x the profile's rate, or the
    passes and the product were timed again on one thread of a quiet core."""
    ceiling: float | None = None
    """The efficiency ceiling as measured on the quiet core the passes were timed alone on
    (None: not timed alone; measure it as usual)."""

    def ceiling_for(self, dtype: torch.dtype, device: torch.device, ceiling_of: Ceiling) -> float:
        """The efficiency ceiling of a model computing in ``dtype``: :attr:`ceiling`, else
        ``ceiling_of(dtype, device)`` measured now."""
        return self.ceiling if self.ceiling is not None else ceiling_of(dtype, device)


def timed_rounds(
    passes: list[tuple[str, Callable[[], None]]],
    device: torch.device,
    hw: HardwareProfile,
    repeats: int,
    timing: Timing,
    what: str,
    recorded: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    *,
    ceiling_of: Ceiling,
) -> Passes:
    """Time ``passes`` (label, run) in turn with a square matrix product after each turn,
    after one untimed warm-up turn, ``repeats`` turns per round, until the checks of the
    module doc hold or ``contention.MAX_ROUNDS`` rounds ran. ``recorded``: an undisturbed
    probe's rates are on record (:mod:`bb_lightning.probe.rate_cache`); a disturbed probe
    says it takes them. ``dtype``: the passes' compute dtype, whose efficiency ceiling ``ceiling_of``
    measures (:func:`~bb_lightning.probe.calibrate.dtype_ceiling`)."""
    n = reference_size(device.type, hw.device_flops)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)

    def product() -> None:
        torch.matmul(a, b.t(), out=out)  # x @ W^T, as a linear layer multiplies
        sync(device)

    ref = f"matmul {n}"
    times: dict[str, list[float]] = {label: [] for label, _ in [*passes, (ref, product)]}
    share = timing.watch()
    for _, run in passes:
        run()
    product()
    rounds = 0
    while True:
        rounds += 1
        for _ in range(repeats):
            for label, run in passes:
                times[label].append(timing.seconds(label, run))
            times[ref].append(timing.seconds(ref, product))
        # the typical product, not the fastest: beside a neighbour spinning on one of two
        # cores most products ran at about half the rate and a lucky one near the full
        # rate, which passed the drift check while the model's passes ran much slower
        rate = 2.0 * n**3 / max(contention.median(times[ref]), 1e-12)
        drift = rate / max(hw.device_flops, 1.0)
        unsteady = contention.unsteady(times)
        # every check, the neighbours' share too: one lucky matrix product among slow
        # ones can pass the drift check while a neighbour slows the model's passes 3 x
        busy = share()
        ok = not unsteady and drift >= contention.DRIFT and busy <= contention.BUSY_SHARE
        if ok or rounds >= contention.MAX_ROUNDS:
            break
    best = {label: contention.fastest(t) for label, t in times.items()}
    if ok:
        return Passes(best, rate, None)
    parts = [f"{label} passes differed {s:.1f} x" for label, s in unsteady.items()]
    if drift < contention.DRIFT:
        parts.append(
            f"matrix products beside them ran at {rate / 1e12:.3g} TFLOP/s (median) = "
            f"{drift:.2f} x the hardware profile's {hw.device_flops / 1e12:.3g}"
        )
    if busy > contention.BUSY_SHARE:
        parts.append(f"other processes took {busy:.0%} of this process's cores")
    drifted = drift < contention.DRIFT
    core, ceiling = None, None
    if not recorded and device.type == "cpu" and busy > contention.BUSY_SHARE:
        core = timing.quiet_core()
    if recorded:
        taken = "taking the rates an undisturbed probe of this model and shape recorded here"
    elif core is not None:
        alone, rate, ceiling = alone_on_core(
            passes, (ref, product, 2.0 * n**3), core, repeats, timing, dtype, device, ceiling_of
        )
        best.update(alone)  # one thread's times, and ``rate`` the product's beside them:
        drifted = True  # efficiencies are relative to it, as beside a busy neighbour
        taken = (
            f"timing the passes with one thread on core {core}, which the others left alone, "
            f"beside a matrix product there ({rate / 1e12:.3g} TFLOP/s), and taking the "
            "model's rate relative to it"
        )
    elif drifted:
        taken = "taking the model's rate relative to the matrix products beside it"
    else:
        taken = "planning with the fastest passes"
    note = (
        f"balance_beam: the {what} stayed unsteady over {rounds} rounds ({'; '.join(parts)}): "
        f"another process is using the device; {taken} (measured steps re-plan after warm-up)"
    )
    warnings.warn(note, RuntimeWarning, stacklevel=3)
    return Passes(best, rate, note, drifted, ceiling)


def alone_on_core(
    passes: list[tuple[str, Callable[[], None]]],
    reference: tuple[str, Callable[[], None], float],
    core: int,
    repeats: int,
    timing: Timing,
    dtype: torch.dtype,
    device: torch.device,
    ceiling_of: Ceiling,
) -> tuple[dict[str, float], float, float]:
    """(the fastest seconds of each pass, the median FLOP/s of the reference product, the
    efficiency ceiling), each run with one thread pinned to ``core``.

    ``reference`` is (label, run, FLOPs) of the square matrix product timed beside the
    passes. The passes' times are one thread's: the probe takes their rate relative to the
    product's on the same thread, which the profile's ``device_flops`` (all threads) then
    scales, as it does beside a busy neighbour (``Passes.drifted``). Dividing one thread's
    time by the thread count instead credited the passes with perfect division among the
    threads, which the engine does not get: on two cores a predict probe's prefill came out
    at 1.5 x the matrix-product probe's rate, and the runs it priced at 0.4-0.6 x that.
    Labels as in ``passes``; the timed series are labelled ``"<label> alone"``. With them,
    ``ceiling_of(dtype, device)`` timed on that core too (beside the neighbour its fp32 /
    bf16 ratio read lower than alone, which capped the credited rate). The thread's
    affinity and torch's thread count are restored afterwards."""
    ref, product, flops = reference
    threads = torch.get_num_threads()
    pin = hasattr(os, "sched_setaffinity")
    keep = os.sched_getaffinity(0) if pin else set()
    torch.set_num_threads(1)
    if pin:
        os.sched_setaffinity(0, {core})  # this thread only: torch's workers sit idle
    try:
        series = [*passes, (ref, product)]
        for _, run in series:
            run()  # warm-up on one thread
        times: dict[str, list[float]] = {label: [] for label, _ in series}
        for _ in range(repeats):
            for label, run in series:
                times[label].append(timing.seconds(f"{label} alone", run))
        ceiling = ceiling_of(dtype, device)
    finally:
        if pin:
            os.sched_setaffinity(0, keep)
        torch.set_num_threads(threads)
    rate = flops / max(contention.median(times.pop(ref)), 1e-12)
    return {label: contention.fastest(t) for label, t in times.items()}, rate, ceiling
