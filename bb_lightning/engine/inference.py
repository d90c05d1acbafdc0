"""Paged inference without optimizer state: what ``predict`` and ``validate`` need.

:class:`InferenceEngine` registers only each block's weights in the compute
dtype in a :class:`storage.store.TieredStore` (homes per
:class:`~bb_lightning.placement.Placement`, ``master`` not read), keeps the
other parameters (embedding, final norm, head) on the device in the compute
dtype, and installs the paged forwards. No fp32 master weights, no AdamW
moments, no gradient accumulators: a bf16 block costs 2 bytes per parameter
in its home tier, where the training engine needs 14.

The engine serves forwards without grad only (``predict`` under
``inference_mode``, ``validate`` under ``no_grad``). :meth:`InferenceEngine.close`
gives the module its parameters back: from the checkpoint again (back on the
meta device) when they were streamed from one, else the store's compute-dtype
weights cast to fp32.

On a CPU device the engine calls :func:`keep_host_allocations`: glibc then
serves the forward's large activations (tens to hundreds of MB in a prefill)
from its heap and keeps freed memory for the next ones, instead of mapping
fresh pages for each and faulting them in (kernel time that the matrix
products on the same cores need). The setting is process-wide. It also keeps what
building the engine freed while it streamed the state into the store (1.4 GiB for a 0.67B
Llama from a bf16 checkpoint), more than a step reuses: the strategy hands that back with
:func:`release_free_heap` once the engine is built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from bb_lightning.engine import host_linear, host_mlp, host_norm, host_rope
from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.flat import (
    ParamLoader,
    block_params,
    buffers_to,
    flat_from,
    set_data,
    torch_dtype,
)
from bb_lightning.engine.grad_sink import GradSink
from bb_lightning.engine.pager import BlockPager
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import ModelSizes, Placement, weights_manifest
from storage.external import FilePiece
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = ["InferenceEngine", "external_blocks", "keep_host_allocations", "release_free_heap"]

PieceSource = Callable[[Tensor], FilePiece | None]
"""A (meta) parameter -> the file piece holding its bytes in the compute dtype, read-only
(a converted store's chunk); None when no file holds them so."""


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
"""glibc ``mallopt`` parameters (``malloc.h``)."""


def keep_host_allocations(max_bytes: int = 1 << 30) -> bool:
    """Serve host allocations of up to ``max_bytes`` bytes from glibc's heap and keep freed memory.

    Sets glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to ``max_bytes``
    (bytes): allocations below it come from the heap instead of a fresh ``mmap``
    each (whose pages the kernel zeroes at first touch), and up to ``max_bytes`` of
    freed memory stays in the process for the next allocation. Process-wide.

    Returns whether the C library accepted both settings (False where it is not glibc).
    Raises ``ValueError`` for ``max_bytes`` outside [1 MiB, 2 GiB).
    """
    if not (1 << 20) <= max_bytes < (1 << 31):
        raise ValueError(
            f"max_bytes={max_bytes} must be in [1 MiB, 2 GiB) bytes: e.g. 1 << 30 (1 GiB)"
        )
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, max_bytes)) & bool(mallopt(_M_TRIM_THRESHOLD, max_bytes))


def host_kernels(model: nn.Module, compute_dtype: torch.dtype) -> Callable[[], None]:
    """Give ``model`` (on a CPU device) the compiled kernels a generation runs: its
    Llama-family RMS norms and rotary embeddings (:func:`~bb_lightning.engine.host_norm.install`,
    :func:`~bb_lightning.engine.host_rope.install`) and, computing in bf16, its gated MLPs'
    activation and product and its products of few rows
    (:func:`~bb_lightning.engine.host_mlp.install`,
    :func:`~bb_lightning.engine.host_linear.install`); return the function that takes them
    all back (nothing is left installed if one install raises)."""
    undo: list[Callable[[], None]] = []
    installs = [host_norm.install, host_rope.install]
    if compute_dtype == torch.bfloat16:
        installs += [host_mlp.install, host_linear.install]
    try:
        for install in installs:
            undo.append(install(model))
    except BaseException:
        for done in reversed(undo):
            done()
        raise

    def restore() -> None:
        for done in undo:
            done()

    return restore


def release_free_heap() -> bool:
    """Give the free memory of glibc's heaps back to the system (``malloc_trim(0)``).

    Under :func:`keep_host_allocations` glibc keeps up to its ``max_bytes`` of freed memory
    at the top of the heap and every freed hole below it, resident. Called between phases
    (after an engine's setup), it leaves the process holding only live allocations; the
    next step's allocations fault their pages in once and are kept again. Returns whether
    the C library released any memory (False where it is not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def external_blocks(
    blocks: Sequence[nn.Module], placement: Placement, pieces: PieceSource | None
) -> dict[int, list[FilePiece]]:
    """The NVMe-homed blocks whose every weight a file holds in the compute dtype
    (``pieces``), each with its file pieces in the order of its flat weights: those
    blocks page straight from the files, with no copy in the run's NVMe tier."""
    if pieces is None:
        return {}
    out: dict[int, list[FilePiece]] = {}
    for i, (block, home) in enumerate(zip(blocks, placement.weights, strict=True)):
        if home is not Tier.NVME:
            continue
        found = [pieces(p) for _, p in block_params(block)]
        if found and all(f is not None for f in found):
            out[i] = [f for f in found if f is not None]
    return out


class InferenceEngine:
    """Executes a placement for forwards without grad: paged compute-dtype weights only."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        store: TieredStore,
        placement: Placement,
        *,
        device: torch.device,
        loader: ParamLoader | None = None,
        external: Mapping[int, Sequence[FilePiece]] | None = None,
    ) -> None:
        """Put ``blocks``' weights in ``store`` and the other parameters on ``device``.

        ``loader`` gives parameter values when the model was built on the meta device
        (each block read into the store one tensor at a time); None reads the
        parameters themselves. ``external`` (:func:`external_blocks`): blocks paged
        read-only from files the run does not own (a converted store's chunks), never
        copied into the store.
        """
        self.model = model
        self.store = store
        self.device = device
        self.compute_dtype = compute_dtype = torch_dtype(placement)
        """The dtype the device computes in (``placement.compute_dtype``)."""
        self.streamed = loader is not None
        self.external = dict(external or {})
        """Blocks read in place from files the run does not own (never written)."""
        """Whether the weights were read from a checkpoint (the module's are on meta)."""
        self._restore_kernels: Callable[[], None] | None = None
        if device.type == "cpu":
            keep_host_allocations()
        self.timer = PhaseTimer(sync=torch.cuda.synchronize if device.type == "cuda" else None)
        """Phase times (``wait_page_in``) of the caller's thread."""
        in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
        self.resident_params = [p for _, p in model.named_parameters() if id(p) not in in_blocks]
        for p in self.resident_params:
            value = loader(p) if loader is not None and p.is_meta else p.detach()
            set_data(p, value.to(device, compute_dtype))
        block_lists = [[p for _, p in block_params(b)] for b in blocks]
        sizes = ModelSizes(blocks=tuple(sum(p.numel() for p in ps) for ps in block_lists))
        self.manifest = weights_manifest(sizes, placement)
        """Every tensor the engine stores (registered from it)."""
        self.pager = BlockPager(
            store,
            blocks,
            placement,
            manifest={t.name: t for t in self.manifest},
            device=device,
            loader=None if loader is None else (lambda i: flat_from(block_lists[i], loader)),
            timer=self.timer,
            weights_only=True,
            external=self.external,
        )
        buffers_to(model, device, compute_dtype)
        self._grads = GradSink()  # never fed: forwards with grad are not served
        self.paged = PagedBlocks(blocks, self.pager, self._grads)
        self.paged.max_tokens = placement.prefill_tokens  # prefill in planned chunks
        self.paged.install()
        self.kernels_on()

    def kernels_on(self) -> None:
        """On a CPU device, run the model's Llama-family RMS norms and rotary embeddings (and,
        computing in bf16, its gated MLPs' activation and product and its products of few
        rows) through the compiled kernels (:func:`~bb_lightning.engine.host_norm.install`,
        :func:`~bb_lightning.engine.host_rope.install`,
        :func:`~bb_lightning.engine.host_mlp.install`,
        :func:`~bb_lightning.engine.host_linear.install`) until :meth:`kernels_off`."""
        if self.device.type == "cpu" and self._restore_kernels is None:
            self._restore_kernels = host_kernels(self.model, self.compute_dtype)

    def kernels_off(self) -> None:
        """Give the model's RMS norms, MLPs and linear layers their class ``forward`` and its model
        files their ``apply_rotary_pos_emb`` back (the module handed back runs as the user
        built it)."""
        if self._restore_kernels is not None:
            self._restore_kernels()
            self._restore_kernels = None

    def _block_names(self) -> list[list[str]]:
        first: dict[int, str] = {}
        for key, p in self.model.named_parameters():
            first.setdefault(id(p), key)
        return [[first[id(p)] for p in params] for params in self.pager.params]

    def load_weights(self, get: Callable[[str], Tensor]) -> None:
        """Set every parameter from ``get(name)`` (any dtype; cast to the compute dtype).

        Raises ``ValueError`` naming a parameter whose value has another shape, or when
        blocks are served read-only from a converted store's files.
        """
        if self.external:
            path = self.external[min(self.external)][0].path
            raise ValueError(
                f"blocks {sorted(self.external)} are served read-only from a converted store "
                f"(e.g. {path}): load other weights into a module built from a Hugging Face "
                "directory, or convert them into a store of their own"
            )
        self.pager.release_all_except(())
        largest = max(sum(math.prod(s) for s in shapes) for shapes in self.pager.shapes)
        scratch = torch.empty(largest, dtype=self.compute_dtype)
        for i, names in enumerate(self._block_names()):
            shapes = self.pager.shapes[i]
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.float32)
            offset = 0
            for key, shape in zip(names, shapes, strict=True):
                n = math.prod(shape)
                flat[offset : offset + n].copy_(_checked(key, shape, get).reshape(-1))
                offset += n
            ticket = self.pager.write_weights(i, flat, scratch)
            if ticket is not None:  # the next block is cast into the same scratch buffer
                ticket.wait_host()
        first = {id(p): k for k, p in reversed(list(self.model.named_parameters()))}
        for p in self.resident_params:
            p.data.copy_(_checked(first[id(p)], tuple(p.shape), get))

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Set the weights from a full state dict; ``ValueError`` names a missing key."""
        missing = [k for k, _ in self.model.named_parameters() if k not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        self.load_weights(lambda key: state_dict[key])

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict, parameters as fp32 host copies of the compute weights."""
        self.pager.release_all_except(())
        values: dict[int, Tensor] = {}
        for i, params in enumerate(self.pager.params):
            flat = self.store.read(self.pager.names[i]).to(torch.float32)
            offset = 0
            for p, shape in zip(params, self.pager.shapes[i], strict=True):
                n = math.prod(shape)
                values[id(p)] = flat[offset : offset + n].view(shape).clone()
                offset += n
        for p in self.resident_params:
            values[id(p)] = p.detach().to("cpu", torch.float32)
        out: dict[str, Tensor] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = values[id(t)] if id(t) in values else t.detach().to("cpu")
        return out

    def close(self) -> None:
        """Restore the blocks' forwards and give the module its parameters back.

        Streamed weights go back to the meta device (a later engine reads the
        checkpoint again); other parameters get the stored weights, cast to fp32.
        The store stays open (its owner closes it).
        """
        state = None if self.streamed else self.state_dict()
        self.kernels_off()
        self.paged.remove()
        self._grads.close()
        shapes: dict[int, tuple[int, ...]] = {}
        for params, block_shapes in zip(self.pager.params, self.pager.shapes, strict=True):
            shapes.update((id(p), s) for p, s in zip(params, block_shapes, strict=True))
        for key, p in self.model.named_parameters():
            if state is not None:
                set_data(p, state[key])
            else:
                shape = shapes.get(id(p), tuple(p.shape))
                _to_meta(p, torch.empty(shape, dtype=torch.float32, device="meta"))


def _checked(key: str, shape: tuple[int, ...], get: Callable[[str], Tensor]) -> Tensor:
    value = get(key)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"parameter {key!r} has shape {tuple(value.shape)} in the state dict but "
            f"{tuple(shape)} in the model: load a state dict of this model"
        )
    return value


def _to_meta(param: Tensor, value: Tensor) -> None:
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
