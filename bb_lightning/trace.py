"""Chrome / Perfetto traces of compute and copy activity (``bb-lightning fit --trace t.json``).

:class:`TraceRecorder` collects complete events (``"ph": "X"``) on named
tracks, one track per thread: ``compute`` for the training loop's thread and
one per copy thread of the store or the gradient sink. :func:`install_trace`
wraps, on the instances only, the pager's ``acquire`` / ``release``, the
store's page-ins and write-backs and the gradient sink's copies, and returns a
handle whose :meth:`TraceHandle.remove` restores them. :class:`TraceCallback`
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
    """The wrappers installed by :func:`install_trace`; :meth:`remove` takes them out."""

    def __init__(self) -> None:
        self._patched: list[tuple[object, str]] = []

    def patch(self, obj: object, name: str, make: Callable[[Any], Any]) -> None:
        """Shadow method ``name`` of instance ``obj`` with ``make(original)``."""
        if name in vars(obj):
            raise ValueError(f"{type(obj).__name__}.{name} is already wrapped: remove it first")
        setattr(obj, name, make(getattr(obj, name)))
        self._patched.append((obj, name))

    def remove(self) -> None:
        """Restore every wrapped method (idempotent)."""
        while self._patched:
            obj, name = self._patched.pop()
            delattr(obj, name)


def install_trace(engine: Any, recorder: TraceRecorder) -> TraceHandle:
    """Trace a :class:`~bb_lightning.engine.trainer_engine.TrainingEngine` into ``recorder``.

    Wraps ``engine.pager.acquire`` / ``release`` (compute track), the store's
    ``prefetch_async`` / ``write_back_async`` and the jobs they submit to its copy
    threads (copy tracks), and ``engine.grads.submit`` (gradient copies).
    """
    handle = TraceHandle()
    pager, store, grads = engine.pager, engine.store, engine.grads
    held: dict[int, float] = {}
    kind = threading.local()

    def close_block(i: int) -> None:
        start = held.pop(i, None)
        if start is not None:
            recorder.add(f"block {i}", COMPUTE, start, recorder.now(), cat="compute")

    def acquire(original: Callable[[int], Any]) -> Callable[[int], Any]:
        def traced(i: int) -> Any:
            close_block(i)
            start = recorder.now()
            out = original(i)
            end = recorder.now()
            recorder.add(f"wait block {i}", COMPUTE, start, end, cat="wait")
            held[i] = end
            return out

        return traced

    def release(original: Callable[[int], Any]) -> Callable[[int], Any]:
        def traced(i: int) -> Any:
            close_block(i)
            return original(i)

        return traced

    def issuing(label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                kind.label = label
                try:
                    return original(*args, **kwargs)
                finally:
                    kind.label = None

            return traced

        return make

    def spanning(label: str, cat: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                with recorder.span(label, COMPUTE, cat=cat):
                    return original(*args, **kwargs)

            return traced

        return make

    def submit(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(rec: Any, work: Callable[..., Any]) -> Any:
            label = getattr(kind, "label", None) or "copy"
            name = f"{label} {getattr(getattr(rec, 'spec', None), 'name', '?')}"

            def timed(*args: Any) -> Any:
                with recorder.span(name, _copy_track(), cat="copy"):
                    return work(*args)

            return original(rec, timed)

        return traced

    def grads_submit(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(work: Callable[[], None]) -> Any:
            def timed() -> None:
                with recorder.span("grads to host", _copy_track(), cat="copy"):
                    work()

            return original(timed)

        return traced

    handle.patch(pager, "acquire", acquire)
    handle.patch(pager, "release", release)
    handle.patch(store, "prefetch_async", issuing("page-in"))
    handle.patch(store, "write_back_async", issuing("write-back"))
    if callable(getattr(store, "_submit", None)):  # the store's one entry to its copy threads
        handle.patch(store, "_submit", submit)
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
