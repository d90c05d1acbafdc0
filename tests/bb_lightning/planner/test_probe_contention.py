"""Probes beside a busy neighbour: the fastest passes count, and a disturbed profile is not
cached. Pass times are scripted through a fake ``Timing`` (the work itself still runs)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from bb_lightning.planner import cost
from bb_lightning.planner.profile import HardwareProfile
from bb_lightning.probe import calibrate, contention, model_profile_from_config, rate_cache
from bb_lightning.probe.calibrate import probe_predict_compute, probe_train_compute
from bb_lightning.probe.contention import Timing
from bb_lightning.probe.measure import ROUNDS, cache_path, machine_identity, measure
from bb_lightning.probe.timed_passes import reference_size

from .test_read_ahead import CPU

measure_module = importlib.import_module("bb_lightning.probe.measure")

LAYERS, SEQ = 4, 16
MORE = 0.006 + min(calibrate.TRAIN_SPANS[0], LAYERS - 1) * 0.004
"""Seconds of the wider train-probe copy (as many blocks as the model): the rest 2 ms and
1 + span blocks of 4 ms."""
PEAK = 1e9
"""The profile's matrix-product rate, FLOP/s (the scripted passes run the tiny model at a
tenth to a half of it)."""


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own cache directory: no probe reads the rates another one recorded."""
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))


class Scripted(Timing):
    """Runs each pass and reports the seconds ``script(label, i)`` gives for its i-th pass;
    matrix products (``"matmul <n>"``) take ``2 n³ / rate(i)`` with ``rate`` from
    ``products``."""

    def __init__(
        self,
        script: Callable[[str, int], float] = lambda label, i: 0.01,
        products: Callable[[int], float] = lambda i: PEAK,
        busy: float = 0.0,
        quiet: int | None = None,
    ) -> None:
        self.script, self.products, self.busy, self.quiet = script, products, busy, quiet
        self.calls: Counter[str] = Counter()

    def seconds(self, label: str, run: Callable[[], None]) -> float:
        run()
        i = self.calls[label]
        self.calls[label] += 1
        size = re.fullmatch(r"matmul (\d+)", label)
        if size is not None:
            return 2 * int(size.group(1)) ** 3 / self.products(i)
        return self.script(label, i)

    def watch(self) -> Callable[[], float]:
        return lambda: self.busy

    def quiet_core(self) -> int | None:
        return self.quiet


def model_dir(tmp_path: Path) -> str:
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def cpu() -> HardwareProfile:
    return HardwareProfile.from_dict({**CPU, "device_flops": PEAK})


def slow_then_fast(fast: dict[str, float], slow_passes: int = 2) -> Callable[[str, int], float]:
    """Each series' first ``slow_passes`` passes take ten times its ``fast`` seconds."""
    return lambda label, i: fast[label] * (10 if i < slow_passes else 1)


def train_flops(path: str) -> float:
    model = model_profile_from_config(LlamaConfig.from_pretrained(path))
    return SEQ * cost.train_flops_per_token(model, SEQ, False)


def test_train_probe_takes_the_fast_passes_after_slow_ones(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    # one block 4 ms, the rest 2 ms: the one-block model 6 ms, the wider one MORE
    timing = Scripted(slow_then_fast({"one": 0.006, "more": MORE}))
    probe = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=3, timing=timing)
    assert probe is not None and probe.note is None
    assert probe.block_s == pytest.approx(0.004) and probe.rest_s == pytest.approx(0.002)
    assert probe.pass_s == pytest.approx(LAYERS * 0.004 + 0.002)
    raw = train_flops(path) / probe.pass_s / PEAK
    assert calibrate.MIN_EFFICIENCY < raw < calibrate.MAX_EFFICIENCY
    assert probe.efficiency == pytest.approx(raw)
    # the first round's fastest pass stood alone (two slow ones), so a second round ran
    assert timing.calls["one"] == timing.calls["more"] == 2 * 3


def test_a_slow_device_beside_the_train_probe_warns_and_rates_against_it(
    tmp_path: Path,
) -> None:
    path = model_dir(tmp_path)
    timing = Scripted(lambda label, i: {"one": 0.006, "more": MORE}[label], lambda i: 0.3 * PEAK)
    with pytest.warns(RuntimeWarning, match="another process is using the device") as record:
        probe = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=timing)
    assert len(record) == 1 and "0.30 x the hardware profile's" in str(record[0].message)
    assert probe is not None and probe.note == str(record[0].message)
    assert timing.calls["one"] == contention.MAX_ROUNDS * 2
    raw = train_flops(path) / probe.pass_s / (0.3 * PEAK)  # against the products beside it
    assert calibrate.MIN_EFFICIENCY < raw < calibrate.MAX_EFFICIENCY
    assert probe.efficiency == pytest.approx(raw)


def test_unsteady_train_passes_warn_and_keep_the_fastest(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    # one fast pass of the one-block model, then only passes three times as slow
    timing = Scripted(lambda label, i: MORE if label == "more" else 0.006 * (1 if i == 0 else 3))
    with pytest.warns(RuntimeWarning, match=r"one passes differed 3\.0 x"):
        probe = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=timing)
    assert probe is not None and probe.note is not None and "fastest passes" in probe.note
    assert timing.calls["one"] == contention.MAX_ROUNDS * 2
    assert probe.block_s == pytest.approx(0.004) and probe.rest_s == pytest.approx(0.002)
    raw = train_flops(path) / probe.pass_s / PEAK  # the profile's rate: the products kept it
    assert probe.efficiency == pytest.approx(raw)


def test_predict_probe_takes_the_fast_passes_after_slow_ones(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    fast = {"prefill one": 0.005, "prefill more": 0.011, "decode one": 0.002, "decode more": 0.004}
    timing = Scripted(slow_then_fast(fast))
    probe = probe_predict_compute(
        path, cpu(), prompt_len=8, concurrent=2, cache_len=16, repeats=3, timing=timing
    )
    assert probe is not None and probe.note is None
    assert probe.prefill_block_s == pytest.approx(0.003)
    assert probe.prefill_rest_s == pytest.approx(0.002)
    assert probe.decode_block_s == pytest.approx(0.001)
    assert probe.decode_rest_s == pytest.approx(0.001)
    assert timing.calls["decode more"] == 2 * 3


def test_a_disturbed_train_probe_takes_the_rate_an_undisturbed_one_recorded(
    tmp_path: Path,
) -> None:
    """Beside a busy neighbour the model's passes slow down more than the matrix products
    (here 4 x against 2 x): the rate an undisturbed probe of the same model and shape
    recorded on this machine is taken instead of the relative one."""
    path = model_dir(tmp_path)
    fast = {"one": 0.006, "more": MORE}
    calm = probe_train_compute(
        path, cpu(), seq_len=SEQ, repeats=2, timing=Scripted(lambda label, i: fast[label])
    )
    assert calm is not None and calm.note is None
    assert (tmp_path / "cache" / rate_cache.FILE_NAME).exists()
    busy = Scripted(lambda label, i: 4 * fast[label], lambda i: 0.5 * PEAK)
    with pytest.warns(RuntimeWarning, match="undisturbed probe of this model and shape"):
        probe = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=busy)
    assert probe is not None and probe.note is not None
    assert probe.efficiency == pytest.approx(calm.efficiency)
    assert probe.tflops == pytest.approx(calm.tflops)
    assert probe.block_s == pytest.approx(calm.block_s)
    # another shape has no record: rated against the products beside it (4 x / 2 x slower)
    with pytest.warns(RuntimeWarning, match="relative to the matrix products"):
        other = probe_train_compute(path, cpu(), seq_len=SEQ, micro_batch=2, repeats=2, timing=busy)
    assert other is not None
    flops = 2 * train_flops(path)
    assert other.efficiency == pytest.approx(flops / other.pass_s / (0.5 * PEAK))


def test_a_busy_neighbour_beside_steady_passes_is_noticed_and_records_nothing(
    tmp_path: Path,
) -> None:
    """A neighbour spinning on one of two cores slows the model's passes steadily (3 x)
    while the fastest of the matrix products beside them may still pass the drift check:
    the neighbours' share of the cores marks the probe disturbed all the same, so it
    neither records its slow rate nor replaces an undisturbed one."""
    path = model_dir(tmp_path)
    fast = {"one": 0.006, "more": MORE}
    calm = probe_train_compute(
        path, cpu(), seq_len=SEQ, repeats=2, timing=Scripted(lambda label, i: fast[label])
    )
    assert calm is not None and calm.note is None
    records = tmp_path / "cache" / rate_cache.FILE_NAME
    before = records.read_text()
    busy = Scripted(lambda label, i: 3 * fast[label], lambda i: 0.65 * PEAK, busy=0.4)
    with pytest.warns(RuntimeWarning, match="other processes took 40%") as warned:
        probe = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=busy)
    assert "undisturbed probe of this model and shape" in str(warned[0].message)
    assert busy.calls["one"] == contention.MAX_ROUNDS * 2
    assert probe is not None and probe.note is not None
    assert probe.tflops == pytest.approx(calm.tflops)  # the recorded rate, not a third of it
    assert records.read_text() == before
    # with no record (a fresh cache) the slow rate is not recorded either
    monkey_cache = tmp_path / "fresh"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BB_CACHE_DIR", str(monkey_cache))
        with pytest.warns(RuntimeWarning, match="other processes took 40%"):
            fresh = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=busy)
    assert fresh is not None and fresh.note is not None
    assert not (monkey_cache / rate_cache.FILE_NAME).exists()


def test_one_lucky_product_beside_a_busy_neighbour_does_not_pass_the_drift_check(
    tmp_path: Path,
) -> None:
    """A neighbour spinning on one of two cores slowed the products beside the predict
    probe to about half the profile's rate, and the model's passes 2.35 x; one product ran
    at the full rate. Judged by its fastest product the probe planned with its slowed
    passes (2.2 x too slow, with no record of this shape); by the median product it rates
    the passes against the products, as the neighbour slowed both."""
    path = model_dir(tmp_path)
    fast = {"prefill one": 0.005, "prefill more": 0.011, "decode one": 0.002, "decode more": 0.004}
    shape = {"prompt_len": 8, "concurrent": 2, "cache_len": 16, "repeats": 2}
    calm = probe_predict_compute(
        path, cpu(), **shape, timing=Scripted(lambda label, i: fast[label])
    )
    assert calm is not None and calm.note is None
    with pytest.MonkeyPatch.context() as mp:  # no record of the undisturbed rates
        mp.setenv("BB_CACHE_DIR", str(tmp_path / "fresh"))
        busy = Scripted(
            lambda label, i: 2.35 * fast[label],
            lambda i: PEAK if i == 1 else 0.5 * PEAK,
            busy=0.41,
        )
        with pytest.warns(RuntimeWarning, match="relative to the matrix products") as warned:
            probe = probe_predict_compute(path, cpu(), **shape, timing=busy)
    assert "0.50 x the hardware profile's" in str(warned[0].message)
    assert probe is not None and probe.note is not None
    assert probe.prefill_s == pytest.approx(2.35 * calm.prefill_s)  # the passes as timed
    # their rate against half the profile's: 2.35 / 2 = 1.18 x the undisturbed time
    assert probe.efficiency == pytest.approx(calm.efficiency * 2 / 2.35)
    assert probe.decode_efficiency == pytest.approx(calm.decode_efficiency)


def test_with_no_record_a_disturbed_probe_times_its_passes_alone_on_a_quiet_core(
    tmp_path: Path,
) -> None:
    """A first run beside a neighbour: no record, and the hardware profile measured beside
    the neighbour too, so the products beside the passes match it and the drift check sees
    nothing, while the neighbours' share of the cores says they are busy. The passes and a
    matrix product are timed again with one thread on the core the neighbour left alone, and
    the passes' rate is taken relative to that product's: here two threads run the passes
    and the product 1.6 x as fast as one (not 2 x), so the probe gives the undisturbed
    efficiencies (the fit benchmark's first run beside a neighbour was priced 2.9 x too slow,
    measured / predicted 0.35). One thread's time counted at two threads' worth would credit
    the passes 2 / 1.6 = 1.25 x their rate."""
    path = model_dir(tmp_path)
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    speedup = 1.6  # of two threads over one, the passes' and the product's alike
    train = {"one": 0.006, "more": MORE}
    predict = {"prefill one": 0.005, "prefill more": 0.011, "decode one": 0.002}
    predict["decode more"] = 0.004
    fast = {**train, **predict}
    shape = {"prompt_len": 8, "concurrent": 2, "cache_len": 16, "repeats": 2}
    quiet = Scripted(lambda label, i: fast[label])
    calm_train = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=quiet)
    calm = probe_predict_compute(path, cpu(), **shape, timing=quiet)
    assert calm_train is not None and calm is not None

    def disturbed(label: str, i: int) -> float:
        alone = label.removesuffix(" alone")
        if size := re.fullmatch(r"matmul (\d+)", alone):  # one thread: 1 / 1.6 of the rate
            return speedup * 2 * int(size.group(1)) ** 3 / PEAK
        return speedup * fast[alone] if alone != label else 3 * fast[label]

    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as mp:  # no record of the undisturbed rates
            mp.setenv("BB_CACHE_DIR", str(tmp_path / "fresh"))
            busy = Scripted(disturbed, busy=0.4, quiet=0)
            with pytest.warns(RuntimeWarning, match="one thread on core 0") as warned:
                probe_t = probe_train_compute(path, cpu(), seq_len=SEQ, repeats=2, timing=busy)
                probe = probe_predict_compute(path, cpu(), **shape, timing=busy)
        # the thread count and this thread's cores are as before
        assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == affinity
    finally:
        torch.set_num_threads(threads)
    assert len(warned) == 2 and all("other processes took 40%" in str(w.message) for w in warned)
    assert busy.calls["one alone"] == busy.calls["decode more alone"] == 2  # repeats
    assert probe_t is not None and probe is not None
    # the passes as timed on one thread, their rate against the product's there
    assert probe_t.pass_s == pytest.approx(speedup * calm_train.pass_s)
    assert probe_t.efficiency == pytest.approx(calm_train.efficiency)
    assert probe.prefill_s == pytest.approx(speedup * calm.prefill_s)
    assert probe.decode_s == pytest.approx(speedup * calm.decode_s)
    assert probe.efficiency == pytest.approx(calm.efficiency)
    assert probe.decode_efficiency == pytest.approx(calm.decode_efficiency)
    assert all("relative to it" in str(w.message) for w in warned)
    assert busy.calls[f"matmul {reference_size('cpu', PEAK)} alone"] == 2 * 2
    # no core left quiet: the fastest passes, as timed
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BB_CACHE_DIR", str(tmp_path / "fresh2"))
        with pytest.warns(RuntimeWarning, match="planning with the fastest passes"):
            slow = probe_train_compute(
                path, cpu(), seq_len=SEQ, repeats=2, timing=Scripted(disturbed, busy=0.4)
            )
    assert slow is not None and slow.pass_s == pytest.approx(3 * calm_train.pass_s)


def test_a_disturbed_predict_probe_takes_the_rates_an_undisturbed_one_recorded(
    tmp_path: Path,
) -> None:
    path = model_dir(tmp_path)
    fast = {"prefill one": 0.005, "prefill more": 0.011, "decode one": 0.002, "decode more": 0.004}
    shape = {"prompt_len": 8, "concurrent": 2, "cache_len": 16, "repeats": 2}
    calm = probe_predict_compute(
        path, cpu(), **shape, timing=Scripted(lambda label, i: fast[label])
    )
    busy = Scripted(lambda label, i: 3 * fast[label], lambda i: 0.4 * PEAK)
    with pytest.warns(RuntimeWarning, match="undisturbed probe of this model and shape"):
        probe = probe_predict_compute(path, cpu(), **shape, timing=busy)
    assert calm is not None and probe is not None
    assert probe.efficiency == pytest.approx(calm.efficiency)
    assert probe.decode_efficiency == pytest.approx(calm.decode_efficiency)
    assert probe.prefill_s == pytest.approx(calm.prefill_s)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_steady_profile_is_cached_with_its_fastest_rates(tmp_path: Path, cache_dir: Path) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    # slow products first (a neighbour), then the machine's own rate
    timing = Scripted(lambda label, i: 0.05, lambda i: 1e10 if i < 2 else 4e10)
    first = measure(nvme_path=str(disk), max_seconds=0.5, cache=False, timing=timing)
    assert first.device_flops == pytest.approx(4e10)
    assert timing.calls["nvme write"] in (ROUNDS, contention.MAX_ROUNDS)
    path = cache_path(machine_identity(str(disk)))
    assert json.loads(path.read_text())["profile"] == first.to_dict()
    again = Scripted()
    cached = measure(nvme_path=str(disk), max_seconds=0.5, timing=again)
    assert not again.calls  # read from the cache, not measured
    assert cached.replace(nvme_capacity=first.nvme_capacity) == first  # free space read anew


def test_a_cached_profiles_disk_rates_are_measured_again_once_old(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk's rates of now replace cached ones older than NVME_MAX_AGE (a disk drifts);
    every other figure stays cached, and younger rates are used as cached."""
    disk = tmp_path / "nvme"
    disk.mkdir()
    first = measure(nvme_path=str(disk), max_seconds=0.5, cache=False, timing=Scripted())
    path = cache_path(machine_identity(str(disk)))

    def aged(seconds: float) -> None:
        entry = json.loads(path.read_text())
        entry["nvme_measured_at"] -= seconds
        path.write_text(json.dumps(entry))

    aged(measure_module.NVME_MAX_AGE - 60)  # still young: no probe runs
    young = Scripted()
    assert measure(nvme_path=str(disk), max_seconds=0.5, timing=young) == first.replace(
        nvme_capacity=shutil.disk_usage(disk).free
    )
    assert not young.calls
    aged(120)  # now older than the limit: the disk's probe alone runs, ROUNDS times
    # the disk now reads 4 x and writes 2 x slower than when the profile was measured
    slower = Scripted(lambda label, i: {"nvme read": 0.04, "nvme write": 0.02}.get(label, 0.01))
    again = measure(nvme_path=str(disk), max_seconds=0.5, timing=slower)
    assert slower.calls == {"nvme read": ROUNDS, "nvme write": ROUNDS}
    assert again.nvme_read_bandwidth == pytest.approx(first.nvme_read_bandwidth / 4)
    assert again.nvme_write_bandwidth == pytest.approx(first.nvme_write_bandwidth / 2)
    fields = {"nvme_read_bandwidth", "nvme_write_bandwidth", "nvme_capacity"}
    kept = {k: v for k, v in first.to_dict().items() if k not in fields}
    assert {k: v for k, v in again.to_dict().items() if k not in fields} == kept
    assert list(disk.iterdir()) == []  # the probe's files removed
    # cached with the rates of now, and their time: the next call probes nothing
    later = Scripted()
    assert measure(nvme_path=str(disk), max_seconds=0.5, timing=later) == again.replace(
        nvme_capacity=shutil.disk_usage(disk).free
    )
    assert not later.calls
    # an entry written before entries said when (no time): measured again
    entry = json.loads(path.read_text())
    del entry["nvme_measured_at"]
    path.write_text(json.dumps(entry))
    old = Scripted()
    measure(nvme_path=str(disk), max_seconds=0.5, timing=old)
    assert old.calls == {"nvme read": ROUNDS, "nvme write": ROUNDS}
    # without an NVMe path nothing of the disk is probed
    none = Scripted()
    measure(max_seconds=0.5, cache=False, timing=Scripted())
    aged_none = cache_path(machine_identity(None))
    entry = json.loads(aged_none.read_text())
    entry["nvme_measured_at"] = 0.0
    aged_none.write_text(json.dumps(entry))
    measure(max_seconds=0.5, timing=none)
    assert not none.calls


def test_a_busy_neighbour_warns_and_the_profile_is_not_cached(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = Counter[str]()
    real_round = measure_module._probe_round

    def counted(*args: Any) -> dict[str, float]:
        rounds["taken"] += 1
        return real_round(*args)

    monkeypatch.setattr(measure_module, "_probe_round", counted)
    timing = Scripted(products=lambda i: 1e10, busy=0.6)
    with pytest.warns(RuntimeWarning, match="not caching") as record:
        profile = measure(max_seconds=0.5, timing=timing)
    assert len(record) == 1 and "other processes took 60%" in str(record[0].message)
    assert rounds["taken"] == contention.MAX_ROUNDS
    assert profile.device_flops == pytest.approx(1e10)
    assert not cache_path(machine_identity(None)).exists()


def figures(
    flops: float, read: float, write: float = 1e9, io_cpu: float = 1e-10
) -> dict[str, float]:
    """One round's figures of every probe (FLOP/s, bytes/s, updates/s, CPU seconds/byte)."""
    rates = {"h2d": 1e10, "d2h": 1e10, "memory": 2e10, "adam": 1e8, "nvme_free": 1e11}
    return rates | {"flops": flops, "nvme_read": read, "nvme_write": write, "nvme_cpu": io_cpu}


@pytest.mark.parametrize(
    ("rounds", "said"),
    [
        # one fast round of matrix products, then only slow ones
        ([figures(4e10, 1e9), figures(1e10, 1e9), figures(1e10, 1e9)], "matrix-product"),
        # one fast round of disk reads, then only slow ones
        ([figures(1e10, 3e9), figures(1e10, 1e9), figures(1e10, 1e9)], "NVMe read"),
    ],
)
def test_unsteady_rounds_warn_and_are_not_cached(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    rounds: list[dict[str, float]],
    said: str,
) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    left = list(rounds)
    monkeypatch.setattr(measure_module, "_probe_round", lambda *args: left.pop(0))
    with pytest.warns(RuntimeWarning, match=f"{said} rates differed") as record:
        profile = measure(nvme_path=str(disk), max_seconds=0.5, timing=Scripted())
    assert len(record) == 1 and not left  # every round taken
    assert profile.device_flops == max(r["flops"] for r in rounds)
    assert profile.nvme_read_bandwidth == max(r["nvme_read"] for r in rounds)
    assert not cache_path(machine_identity(str(disk))).exists()


def test_rounds_that_agree_after_a_disturbed_one_are_cached(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    left = [figures(1e10, 1e9, io_cpu=9e-11), figures(4e10, 1e9), figures(3.5e10, 1.2e9)]
    monkeypatch.setattr(measure_module, "_probe_round", lambda *args: left.pop(0))
    profile = measure(nvme_path=str(disk), max_seconds=0.5, timing=Scripted())
    assert not left and profile.device_flops == 4e10 and profile.nvme_read_bandwidth == 1.2e9
    assert profile.nvme_cpu_seconds_per_byte == 9e-11  # a cost: the least of the rounds
    cached = json.loads(cache_path(machine_identity(str(disk))).read_text())["profile"]
    assert cached == profile.to_dict()


def test_the_train_probe_builds_a_hybrid_model_of_any_depth(tmp_path: Path) -> None:
    """A config listing each layer's kind (Qwen3-Next: linear attention, then full) is
    probed with copies of other depths, the kinds cycled to their length."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_next", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "model")
    timing = Scripted(lambda label, i: {"one": 0.006}.get(label, 0.01))
    probe = probe_train_compute(str(tmp_path / "model"), cpu(), seq_len=SEQ, repeats=2,
                                timing=timing)  # fmt: skip
    assert probe is not None and timing.calls["one"] == 2 and timing.calls["more"] == 2
