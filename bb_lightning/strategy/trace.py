"""Chrome / Perfetto traces of compute and copy activity (``bb-lightning fit --trace t.json``).

:class:`TraceRecorder` collects complete events (``"ph": "X"``) on named
tracks, one track per thread: ``compute`` for the training loop's thread and
one per copy thread of the store or the gradient sink. :func:`install_trace`
subscribes to the pager's and the store's observer hooks
(:mod:`bb_lightning.engine.observers`, :mod:`storage.observers`), wraps the
gradient sink's copies and the optimizer step on the instances only, and returns
a handle whose :meth:`TraceHandle.remove` takes all of it out again. :class:`TraceCallback`
does both for a Lightning run and writes the file at the end; open it in
``chrome://tracing`` or https://ui.perfetto.dev.

Events on the ``compute`` track:

- ``wait block i``: the loop waited for block ``i`` to arrive (exposed transfer);
- ``block i``: block ``i`` held on the device, from its arrival to its release
  (forward, backward and recomputation of that block).

Events on the copy tracks: ``page-in NAME``, ``write-back NAME``, ``copy NAME``
(other store transfers) and ``grads to host``, each timed on the thread that
ran it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from storage.observers import TransferKind

__all__ = ["TraceCallback", "TraceHandle", "TraceRecorder", "install_trace"]

COMPUTE = "compute"
"""Track of the training loop's thread."""


class TraceRecorder:
    """Thread-safe collector of complete events; timestamps in microseconds since creation."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}

    def now(self) -> float:
        """Microseconds since the recorder was created."""
        return (time.perf_counter_ns() - self._t0) / 1000.0

    def add(
        self,
        name: str,
        track: str,
        start_us: float,
        end_us: float,
        *,
        cat: str,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Record one complete event ``[start_us, end_us]`` (microseconds) on ``track``."""
        with self._lock:
            tid = self._tids.setdefault(track, len(self._tids) + 1)
            event = {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": start_us,
                "dur": max(0.0, end_us - start_us),
                "pid": os.getpid(),
                "tid": tid,
            }
            if args:
                event["args"] = args
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, track: str, *, cat: str) -> Iterator[None]:
        """Record the time spent inside the block as one event."""
        start = self.now()
        try:
            yield
        finally:
            self.add(name, track, start, self.now(), cat=cat)

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of the complete events recorded so far."""
        with self._lock:
            return list(self._events)

    def to_json(self) -> dict[str, Any]:
        """``{"traceEvents": [...]}``: track names first, then events sorted by time per track."""
        with self._lock:
            events = sorted(self._events, key=lambda e: (e["tid"], e["ts"]))
            names = [
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": os.getpid(),
                    "tid": tid,
                    "args": {"name": track},
                }
                for track, tid in self._tids.items()
            ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace as JSON at ``path`` (parent directories created); the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json()), encoding="utf-8")
        return out


def _copy_track() -> str:
    return f"copy: {threading.current_thread().name}"


class TraceHandle:
    """The wrappers and observers installed by :func:`install_trace`; :meth:`remove` takes
    them out."""

    def __init__(self) -> None:
        self._patched: list[tuple[object, str]] = []
        self._undo: list[Callable[[], None]] = []

    def patch(self, obj: object, name: str, make: Callable[[Any], Any]) -> None:
        """Shadow method ``name`` of instance ``obj`` with ``make(original)``."""
        if name in vars(obj):
            raise ValueError(f"{type(obj).__name__}.{name} is already wrapped: remove it first")
        setattr(obj, name, make(getattr(obj, name)))
        self._patched.append((obj, name))

    def observe(self, owner: Any, observer: object) -> None:
        """Add ``observer`` to ``owner`` (``add_observer``) until :meth:`remove`."""
        owner.add_observer(observer)
        self._undo.append(lambda: owner.remove_observer(observer))

    def remove(self) -> None:
        """Restore every wrapped method and drop every observer (idempotent)."""
        while self._patched:
            obj, name = self._patched.pop()
            delattr(obj, name)
        while self._undo:
            self._undo.pop()()


_COPY_LABELS = {TransferKind.PAGE_IN: "page-in", TransferKind.WRITE_BACK: "write-back"}
"""Event name stem of each store transfer kind; the others are ``copy``."""


class _BlockSpans:
    """Pager observer: ``wait block i`` while ``acquire(i)`` waits, then ``block i`` while held."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self._recorder = recorder
        self._waiting: dict[int, float] = {}
        self._held: dict[int, float] = {}

    def _close(self, i: int) -> None:
        start = self._held.pop(i, None)
        if start is not None:
            self._recorder.add(f"block {i}", COMPUTE, start, self._recorder.now(), cat="compute")

    def block_acquiring(self, i: int) -> None:
        self._close(i)
        self._waiting[i] = self._recorder.now()

    def block_acquired(self, i: int) -> None:
        end = self._recorder.now()
        start = self._waiting.pop(i, end)
        self._recorder.add(f"wait block {i}", COMPUTE, start, end, cat="wait")
        self._held[i] = end

    def block_released(self, i: int) -> None:
        self._close(i)


class _CopySpans:
    """Store observer: one event per transfer, on the track of the copy thread that ran it."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self._recorder = recorder
        self._local = threading.local()

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        stack = self._local.__dict__.setdefault("starts", [])
        stack.append((_copy_track(), self._recorder.now()))

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        track, start = self._local.starts.pop()
        label = f"{_COPY_LABELS.get(kind, 'copy')} {name}"
        self._recorder.add(label, track, start, self._recorder.now(), cat="copy")


def install_trace(engine: Any, recorder: TraceRecorder) -> TraceHandle:
    """Trace a :class:`~bb_lightning.engine.trainer_engine.TrainingEngine` into ``recorder``.

    Observes ``engine.pager``'s acquires and releases (compute track) and the store's
    transfers on its copy threads (copy tracks); wraps ``engine.grads.submit`` (gradient
    copies) and ``engine.optimizer_step``.
    """
    handle = TraceHandle()
    pager, store, grads = engine.pager, engine.store, engine.grads

    def spanning(label: str, cat: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                with recorder.span(label, COMPUTE, cat=cat):
                    return original(*args, **kwargs)

            return traced

        return make

    def grads_submit(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(work: Callable[[], None]) -> Any:
            def timed() -> None:
                with recorder.span("grads to host", _copy_track(), cat="copy"):
                    work()

            return original(timed)

        return traced

    handle.observe(pager, _BlockSpans(recorder))
    handle.observe(store, _CopySpans(recorder))
    handle.patch(grads, "submit", grads_submit)
    if callable(getattr(engine, "optimizer_step", None)):
        handle.patch(engine, "optimizer_step", spanning("optimizer step", "optimizer"))
    return handle


class TraceCallback(Callback):
    """Record a trace of every ``trainer.*`` call and write it to ``path`` at the end."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Args: path: the JSON file to write (Chrome trace event format)."""
        self.path = Path(path)
        self.recorder = TraceRecorder()
        self._handle: TraceHandle | None = None
        self._engine: Any = None

    def _install(self, trainer: pl.Trainer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or engine is self._engine:
            return
        self._remove()
        self._handle = install_trace(engine, self.recorder)
        self._engine = engine

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle, self._engine = None, None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._install(trainer)  # the engine may be rebuilt by a re-plan

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the wrappers and write the file."""
        self._remove()
        written = self.recorder.write(self.path)
        rank_zero_info(
            f"trace: {len(self.recorder.events)} events -> {written} "
            "(open in https://ui.perfetto.dev or chrome://tracing)"
        )
