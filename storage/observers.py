"""Observer hooks: who wants to see a :class:`storage.store.TieredStore`'s transfers.

A :class:`TransferObserver` added with :meth:`TieredStore.add_observer` is called on
the copy thread that runs each page-in, write-back and read, when it starts and when
it ends (also when it fails), so a tracer or a profiler can time the store's work
without wrapping its methods. With no observer the store pays one ``None`` check per
transfer. Observers run on the copy threads: they must be thread-safe and quick, and
an exception they raise fails the transfer.

:func:`added` / :func:`removed` keep an immutable tuple of observers (``None`` when
empty), the form every owner of hooks here stores, so a transfer in flight iterates
a snapshot while observers come and go.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol, TypeVar

__all__ = ["TransferKind", "TransferObserver", "added", "observed", "removed"]

T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")


class TransferKind(enum.StrEnum):
    """What a store transfer does."""

    PAGE_IN = "page-in"
    """A tensor copied from its home into a device slot (:meth:`TieredStore.prefetch_async`)."""
    WRITE_BACK = "write-back"
    """A device copy (or a given tensor) written to its home (:meth:`TieredStore.write_back_async`)."""
    READ = "read"
    """Home contents copied into a host tensor (:meth:`TieredStore.read_async`)."""


class TransferObserver(Protocol):
    """Called on the copy thread that runs a transfer of tensor ``name``."""

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        """The transfer is about to run."""

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        """The transfer ran (or raised)."""


def added(observers: tuple[T, ...] | None, observer: T) -> tuple[T, ...]:
    """``observers`` with ``observer`` appended; ``ValueError`` when it is already there."""
    current = observers or ()
    if any(o is observer for o in current):
        raise ValueError(f"{observer!r} is already observing: remove it first")
    return (*current, observer)


def removed(observers: tuple[T, ...] | None, observer: T) -> tuple[T, ...] | None:
    """``observers`` without ``observer`` (a no-op when absent); ``None`` when none is left."""
    left = tuple(o for o in observers or () if o is not observer)
    return left or None


def observed(
    work: Callable[[A], R],
    observers: tuple[TransferObserver, ...],
    kind: TransferKind,
    name: str,
) -> Callable[[A], R]:
    """``work`` that tells ``observers`` when it starts and when it ends."""

    def run(arg: A) -> R:
        for o in observers:
            o.transfer_started(kind, name)
        try:
            return work(arg)
        finally:
            for o in reversed(observers):
                o.transfer_finished(kind, name)

    return run
