"""Arenas: one buffer carved at setup and handed out as aligned slots.

:class:`SlotAllocator` is a first-fit free-list allocator over byte offsets
(aligned offsets, padded lengths, coalescing on free). :class:`Arena` pairs it
with one ``uint8`` buffer and hands out :class:`Slot` views, so tensors placed
in an arena never allocate memory of their own. :class:`DeviceArena` is the
arena in the compute device's memory; :mod:`storage.host` builds the host
arena from the same classes.

Slot offsets are multiples of :data:`storage.io.ALIGNMENT` (4 KiB) and slot
lengths are padded to it, so a slot can be the destination or source of an
``O_DIRECT`` transfer as it is.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storage.io import ALIGNMENT, mapped_empty
from storage.tiers import format_bytes

__all__ = ["Arena", "ArenaFullError", "DeviceArena", "Slot", "SlotAllocator", "resolve_device"]
__all__ += ["slot_bytes"]


class ArenaFullError(ValueError):
    """An arena has no free extent large enough for a request."""


def slot_bytes(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Bytes a slot for ``nbytes`` takes: rounded up to ``alignment``, at least one unit."""
    if nbytes < 0:
        raise ValueError(f"slot size {nbytes} bytes is negative: give a size >= 0")
    return max(alignment, -(-nbytes // alignment) * alignment)


class SlotAllocator:
    """First-fit allocator of aligned byte ranges inside ``[0, capacity)``.

    Free extents are kept sorted by offset and merged with their neighbours
    on :meth:`free`. Thread-safe.
    """

    def __init__(self, capacity: int, *, label: str, alignment: int = ALIGNMENT) -> None:
        """``capacity`` in bytes (rounded down to ``alignment``); ``label`` names it in errors."""
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} bytes is not a power of two: use 4096")
        if capacity < 0:
            raise ValueError(f"{label} arena capacity {capacity} bytes is negative: give >= 0")
        self.label = label
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        """Usable bytes, a multiple of ``alignment``."""
        self._starts: list[int] = [0] if self.capacity else []
        self._lengths: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes in allocated slots (padded lengths)."""
        with self._lock:
            return sum(self._taken.values())

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents."""
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        """Length of the largest free extent, in bytes."""
        with self._lock:
            return max(self._lengths.values(), default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(offset, length)`` pairs sorted by offset, in bytes."""
        with self._lock:
            return [(s, self._lengths[s]) for s in self._starts]

    def allocate(self, nbytes: int, *, owner: str) -> tuple[int, int]:
        """Take the first free extent that fits; returns ``(offset, length)`` in bytes.

        Raises :class:`ArenaFullError` naming ``owner``, the bytes needed, the
        bytes free and the largest free extent.
        """
        length = slot_bytes(nbytes, self.alignment)
        with self._lock:
            for i, start in enumerate(self._starts):
                extent = self._lengths[start]
                if extent < length:
                    continue
                del self._lengths[start]
                if extent == length:
                    del self._starts[i]
                else:
                    self._starts[i] = start + length
                    self._lengths[start + length] = extent - length
                self._taken[start] = length
                return start, length
            free = self.capacity - sum(self._taken.values())
            largest = max(self._lengths.values(), default=0)
        raise ArenaFullError(
            f"tensor {owner!r} needs a slot of {format_bytes(length)} ({length} bytes) in the "
            f"{self.label} arena, but only {format_bytes(free)} ({free} bytes) of its "
            f"{format_bytes(self.capacity)} are free (largest free extent {largest} bytes): "
            f"raise the {self.label} budget or release tensors before paging more in"
        )

    def free(self, offset: int) -> int:
        """Return the slot at ``offset`` to the free list; returns its length in bytes."""
        with self._lock:
            length = self._taken.pop(offset)
            i = bisect.bisect_left(self._starts, offset)
            start, end = offset, offset + length
            # merge with the following extent
            if i < len(self._starts) and self._starts[i] == end:
                end += self._lengths.pop(self._starts.pop(i))
            # merge with the preceding extent
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._lengths[prev] == start:
                    start = prev
                    del self._lengths[prev]
                    i -= 1
                    del self._starts[i]
            self._starts.insert(i, start)
            self._lengths[start] = end - start
            return length


@dataclass(frozen=True)
class Slot:
    """A range of an arena's buffer: ``length`` bytes at ``offset``, holding ``nbytes``."""

    buffer: torch.Tensor
    """The arena's whole ``uint8`` buffer."""
    offset: int
    """Start of the slot in the buffer, in bytes (a multiple of 4 KiB)."""
    length: int
    """Padded length of the slot, in bytes (a multiple of 4 KiB)."""
    nbytes: int
    """Bytes of the tensor held in the slot."""

    def raw(self) -> torch.Tensor:
        """The whole padded slot as a ``uint8`` tensor (``length`` bytes)."""
        return self.buffer[self.offset : self.offset + self.length]

    def view(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The slot's first ``nbytes`` bytes seen as a tensor of ``shape`` and ``dtype``."""
        data = self.buffer[self.offset : self.offset + self.nbytes]
        return data.view(dtype).view(tuple(shape))


class Arena:
    """One ``uint8`` buffer carved into slots by a :class:`SlotAllocator`."""

    def __init__(self, buffer: torch.Tensor, *, label: str) -> None:
        """``buffer`` is a contiguous 1-D ``uint8`` tensor starting at a 4 KiB boundary."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(
                f"{label} arena buffer must be a contiguous 1-D uint8 tensor, got "
                f"{buffer.dtype} with shape {tuple(buffer.shape)}"
            )
        if buffer.data_ptr() % ALIGNMENT:
            raise ValueError(
                f"{label} arena buffer starts at address {buffer.data_ptr():#x}, not a multiple "
                f"of {ALIGNMENT} bytes: allocate it with storage.io.aligned_empty"
            )
        self.buffer = buffer
        self.allocator = SlotAllocator(buffer.numel(), label=label)

    @property
    def capacity(self) -> int:
        """Usable bytes of the arena."""
        return self.allocator.capacity

    @property
    def used(self) -> int:
        """Bytes in allocated slots."""
        return self.allocator.used

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s first byte lies in this arena's buffer."""
        start = self.buffer.data_ptr()
        return (
            tensor.device == self.buffer.device
            and self.buffer.numel() > 0
            and start <= tensor.data_ptr() < start + self.buffer.numel()
        )

    def allocate(self, nbytes: int, *, owner: str) -> Slot:
        """A slot holding ``nbytes`` bytes for tensor ``owner`` (raises :class:`ArenaFullError`)."""
        offset, length = self.allocator.allocate(nbytes, owner=owner)
        return Slot(buffer=self.buffer, offset=offset, length=length, nbytes=nbytes)

    def free(self, slot: Slot) -> None:
        """Return ``slot`` to the arena."""
        assert slot.buffer is self.buffer, "slot freed into an arena it does not belong to"
        self.allocator.free(slot.offset)


class DeviceArena(Arena):
    """The arena in the compute device's memory.

    On CUDA the buffer is one ``torch.empty`` of ``capacity`` bytes on the
    device; on the CPU it is a mapping of its own (:func:`storage.io.mapped_empty`: pages
    touched only when slots are written, huge pages where the kernel gives them), so NVMe
    reads can land in slots directly.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        """``capacity`` in bytes (rounded down to 4 KiB); ``device`` the compute device."""
        capacity -= capacity % ALIGNMENT
        if device.type == "cuda":
            # over-allocate one unit so the slots can start at a 4 KiB boundary
            whole = torch.empty(capacity + ALIGNMENT, dtype=torch.uint8, device=device)
            skip = -whole.data_ptr() % ALIGNMENT
            buffer = whole[skip : skip + capacity]
        else:
            buffer = mapped_empty(capacity)[:capacity]
        super().__init__(buffer, label="device")
        self.device = device


def resolve_device(spec: str | None) -> torch.device:
    """The compute device for ``StoreConfig.device`` (``ValueError`` when unusable)."""
    if spec is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"StoreConfig.device={spec!r} is not a device: use 'cuda' or 'cpu'"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"StoreConfig.device={spec!r}: only 'cuda[:N]' and 'cpu' are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"StoreConfig.device={spec!r} but CUDA is not available: use 'cpu'")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"StoreConfig.device={spec!r} but only {torch.cuda.device_count()} CUDA devices exist"
        )
    return torch.device("cuda", index)
