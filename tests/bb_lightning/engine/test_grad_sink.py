"""GradSink: gradients reach the worker exactly, through reused host buffers, with at
most two batches pending (under the CPU double, where device-to-host copies land only
when the host synchronises on them)."""

from __future__ import annotations

import threading

import pytest
import torch

from bb_lightning.engine.grad_sink import GradSink
from storage.store import StoreConfig, TieredStore

MiB = 1 << 20


def _double_store() -> TieredStore:
    return TieredStore(
        StoreConfig(device_budget=MiB, host_budget=MiB, device="cpu", cuda_double=True)
    )


def _grads(seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(33, 7, generator=g).to(torch.bfloat16),
        None,
        torch.randn(1000, generator=g),
        torch.randn(5, generator=g).to(torch.float16),
    ]


def test_gradients_arrive_exact_through_the_store_copies() -> None:
    with _double_store() as store:
        sink = GradSink(store=store)
        seen: list[list[torch.Tensor | None]] = []
        sent = [_grads(k) for k in range(6)]
        for grads in sent:
            sink.process_async(
                grads, lambda h: seen.append([None if t is None else t.clone() for t in h])
            )
        sink.wait()
        assert len(seen) == len(sent)
        for got, want in zip(seen, sent, strict=True):
            for a, b in zip(got, want, strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b)
        assert store.stats()["d2h"].count == 3 * len(sent)  # one copy per gradient
        assert store._io.double is not None and store._io.double.poisoned_bytes > 0
        assert len(sink._buffers) <= sink.max_pending  # buffers are reused, not one per batch
        sink.close()


class _Slots:
    """The sink's slots, telling when a caller has to wait for one (an event, no clock)."""

    def __init__(self, inner: threading.BoundedSemaphore) -> None:
        self._inner = inner
        self.blocked = threading.Event()

    def acquire(self) -> bool:
        if not self._inner.acquire(blocking=False):
            self.blocked.set()
            return self._inner.acquire()
        return True

    def release(self) -> None:
        self._inner.release()


HANG = 120.0
"""Seconds after which a thread that never arrives fails the test (a hang guard only)."""


def test_at_most_two_batches_are_pending() -> None:
    """While the worker is held, a third batch blocks the caller; nothing is lost."""
    with _double_store() as store:
        sink = GradSink(store=store)
        slots = _Slots(sink._slots)
        sink._slots = slots  # type: ignore[assignment]
        gate = threading.Event()
        order: list[int] = []

        def work(k: int) -> None:
            gate.wait()
            order.append(k)

        issued: list[int] = []

        def backward() -> None:
            for k in range(5):
                sink.process_async(_grads(k), lambda _h, k=k: work(k))
                issued.append(k)

        producer = threading.Thread(target=backward, daemon=True)
        producer.start()
        try:
            assert slots.blocked.wait(HANG), "no batch ever waited for a slot"
            assert issued == [0, 1]  # the third waits for a free slot, the worker being held
        finally:
            gate.set()  # a failed check leaves no thread waiting
        producer.join(HANG)
        assert not producer.is_alive()
        sink.wait()
        assert order == [0, 1, 2, 3, 4] and sink.peak_pending == 2
        sink.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gradients_arrive_exact_with_the_device_busy() -> None:
    """bf16 CUDA gradients, each produced behind a sleep kernel and freed at once,
    reach the worker exact through the pinned buffers (no synchronize() anywhere)."""
    grads = [torch.randn(4 * MiB, device="cuda").to(torch.bfloat16) for _ in range(5)]
    want = [g.cpu() for g in grads]
    with TieredStore(StoreConfig(device_budget=MiB, host_budget=MiB, device="cuda")) as store:
        sink = GradSink(store=store)
        seen: list[torch.Tensor] = []
        for g in grads:
            torch.cuda._sleep(int(2e7))
            sink.process_async([g * 1], lambda h: seen.append(h[0].clone()))  # type: ignore[union-attr]
        sink.wait()
        sink.close()
    assert len(seen) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(seen, want, strict=True))
    assert sink.peak_pending <= 2


def test_a_thread_limited_worker_leaves_every_other_thread_its_count() -> None:
    """``threads=1``: the worker's torch ops run on one thread; the caller and threads
    started later keep the process's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sink = GradSink(threads=1)
        seen: list[int] = []
        sink.submit(lambda: seen.append(torch.get_num_threads()))
        sink.wait()
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [1]
        assert torch.get_num_threads() == 2 and later == [2]
        unlimited = GradSink()
        unlimited.submit(lambda: seen.append(torch.get_num_threads()))
        unlimited.wait()
        assert seen == [1, 2]
        sink.close()
        unlimited.close()
        with pytest.raises(ValueError, match="threads=0"):
            GradSink(threads=0)
    finally:
        torch.set_num_threads(before)


def test_inline_work_runs_on_the_calling_thread_and_raises_at_wait() -> None:
    """``inline``: each batch's work runs at once on the caller's thread with the caller's
    thread count, exact and in order, through the store's copies too; a failure surfaces
    at :meth:`GradSink.wait` as a worker's does, and the slots are all free again."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _double_store() as store:
            sink = GradSink(store=store, threads=1, inline=True)
            caller = threading.get_ident()
            runs: list[tuple[int, int, list[torch.Tensor | None]]] = []
            sent = [_grads(k) for k in range(4)]
            for grads in sent:
                sink.process_async(
                    grads,
                    lambda h: runs.append(
                        (
                            threading.get_ident(),
                            torch.get_num_threads(),
                            [None if t is None else t.clone() for t in h],
                        )
                    ),
                )
            assert len(runs) == len(sent)
            assert all(ident == caller and threads == 2 for ident, threads, _ in runs)
            for (_, _, got), want in zip(runs, sent, strict=True):
                for a, b in zip(got, want, strict=True):
                    assert (a is None) == (b is None)
                    if a is not None and b is not None:
                        assert a.dtype == b.dtype and torch.equal(a, b)

            def fail(_h: object) -> None:
                raise RuntimeError("block 3 failed")

            sink.process_async(_grads(9), fail)
            done: list[int] = []
            sink.submit(lambda: done.append(threading.get_ident()))
            assert done == [caller]  # later work still runs
            with pytest.raises(RuntimeError, match="block 3 failed"):
                sink.wait()
            sink.wait()  # reported once
            for k in range(sink.max_pending + 1):  # every slot was given back
                sink.process_async(_grads(k), lambda _h: None)
            sink.wait()
            assert sink.peak_pending == 1
            sink.close()
    finally:
        torch.set_num_threads(before)


def test_gradients_copied_off_a_device_are_summed_in_link_sized_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where gradients come by copy from the device (the CUDA double), the worker converts
    and sums them in 16 MiB pieces (its thread team splits each), the sum exact; a CPU
    device's stay in 1 MiB pieces. (Pieces are torch's path: without the compiled sum.)"""
    from bb_lightning.engine import grad_sink
    from bb_lightning.engine.grad_sink import CONVERT_CHUNK, LINK_CHUNK, _chunks, add_converted

    monkeypatch.setattr(grad_sink.host_norm, "kernel", lambda: None)
    n = LINK_CHUNK + 3 * CONVERT_CHUNK + 5  # a partial last piece either way
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    acc = torch.randn(n, generator=g)
    want = acc + grad.float()
    seen: list[int] = []

    def work(host: list[torch.Tensor | None]) -> None:
        assert host[0] is not None
        add_converted(acc, host[0])
        seen.append(int(_chunks.buf.numel()))

    store = TieredStore(
        StoreConfig(device_budget=8 * MiB, host_budget=8 * MiB, device="cpu", cuda_double=True)
    )
    with store:
        sink = GradSink(store=store)
        sink.process_async([grad], work)  # type: ignore[arg-type]
        sink.wait()
        sink.close()
    assert seen == [LINK_CHUNK] and torch.equal(acc, want)
    cpu = GradSink()
    cpu.process_async([grad], lambda host: seen.append(0))
    cpu.submit(lambda: seen.append(int(getattr(_chunks, "piece", CONVERT_CHUNK))))
    cpu.close()
    assert seen[-1] == CONVERT_CHUNK
