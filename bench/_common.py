"""Shared pieces of the benchmarks: machine description, step timer, memory sampler.

Not a benchmark itself. The scripts in this folder import it as ``_common``
(the script's folder is on ``sys.path`` when run as ``python bench/x.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lightning
import lightning.pytorch as pl
import psutil
import torch
import transformers
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from bb_lightning.engine.trainer_engine import TrainingEngine
    from bb_lightning.placement import Placement
    from bb_lightning.strategy.core import BalanceBeamStrategy
    from storage.store import TieredStore

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
R = TypeVar("R")


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, device) holding ``path``."""
    best = ("/", "?", "?")
    real = str(path.resolve())
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    return best


def nvme_base(given: str | None) -> Path:
    """``given`` (created), else ``<tmp>/bb-bench-nvme`` on a real disk (never tmpfs).

    The directory is stable across runs so that the planner's measured hardware
    profile (cached per NVMe path) is measured once.
    """
    if given is not None:
        path = Path(given)
    else:
        tmp = Path(tempfile.gettempdir())
        base = REPO / "bench" / "results" if mount_of(tmp)[1] in ("tmpfs", "ramfs") else tmp
        path = base / "bb-bench-nvme"
    path.mkdir(parents=True, exist_ok=True)
    fstype = mount_of(path)[1]
    if fstype in ("tmpfs", "ramfs"):
        print(f"warning: {path} is on {fstype}, not a disk: NVMe figures measure RAM")
    return path


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "?"


def cpu_flags() -> tuple[set[str], str]:
    """(the CPU's feature flags, ``"family F model M"``) from ``/proc/cpuinfo`` (empty, ``"?"``
    elsewhere)."""
    flags: set[str] = set()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key in ("cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                elif not line.strip() and flags:
                    break
    except OSError:
        pass
    if not fields:
        return flags, "?"
    return flags, f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def cpu_kind() -> str:
    """The machine kind by its fastest bf16 matrix instructions: ``"amx"`` (Intel AMX),
    ``"avx512_bf16"`` (AVX-512 with bf16 dot products, no AMX) or ``"no_bf16"`` (neither:
    bf16 products run 5-10 x slower than fp32 there)."""
    flags, _ = cpu_flags()
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "no_bf16"


def best_seconds(runs: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Least seconds of each of ``runs`` over repeats within ``seconds`` (at least three
    each), taken in turns, one of each per round, so that a neighbour's load on this
    shared machine slows each of them alike and their ratio holds."""
    for run in runs.values():
        run()  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    rounds = 0
    deadline = time.perf_counter() + seconds
    while rounds < 3 or time.perf_counter() < deadline:
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
    return best


def machine(nvme_dir: Path | None) -> str:
    """Lines describing this machine, the NVMe directory's filesystem and the versions."""
    mem = psutil.virtual_memory()
    lines = [
        f"machine: CPU {cpu_model()} ({cpu_flags()[1]}, matrix kind {cpu_kind()}), "
        f"{os.cpu_count()} cores, "
        f"RAM {mem.total / GIB:.1f} GiB ({mem.available / GIB:.1f} GiB available), "
        f"kernel {platform.release()}",
        "load average (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"versions: python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), lightning {lightning.__version__}, "
        f"transformers {transformers.__version__}",
    ]
    if nvme_dir is not None:
        mnt, fstype, dev = mount_of(nvme_dir)
        free = psutil.disk_usage(str(nvme_dir)).free
        lines.append(
            f"NVMe dir: {nvme_dir} on {fstype} {dev} (mounted at {mnt}), {free / GIB:.1f} GiB free"
        )
    return "\n".join(lines)


def machine_facts() -> dict[str, Any]:
    """This machine as JSON-ready facts: CPU model, family and model, matrix kind
    (:func:`cpu_kind`), cores, RAM (GiB), torch version, load average now (1/5/15 min)."""
    return {
        "cpu": cpu_model(),
        "id": cpu_flags()[1],
        "kind": cpu_kind(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
        "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def write_figures(path: str | None, bench: str, figures: dict[str, Any]) -> None:
    """``figures`` as JSON at ``path`` (nothing when None) with the machine and the command line.

    What ``bench/cpu_check.py`` collects from each benchmark it runs (``--json PATH``).
    Values are the figures the benchmark printed (ratios, tokens/s, seconds), None where
    it measured nothing (a peer that could not run). Written whole or not at all.
    """
    if path is None:
        return
    doc = {"bench": bench, "argv": sys.argv[1:], "machine": machine_facts(), "figures": figures}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    """``count`` sequences of ``seq_len`` uniformly random token ids below ``vocab``."""

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, seq_len), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def token_loader(
    micro_batch: int, batches: int, seq_len: int, vocab: int
) -> DataLoader[dict[str, torch.Tensor]]:
    """``batches`` micro-batches of ``micro_batch`` x ``seq_len`` random tokens, in order."""
    data = RandomTokens(micro_batch * batches, seq_len, vocab)
    return DataLoader(data, batch_size=micro_batch, shuffle=False)


PHASES = ("forward", "backward", "after_backward", "optimizer")


@dataclass
class StepRecord:
    """Seconds spent in each phase of one optimizer step (summed over its micro-batches)."""

    seconds: float = 0.0
    """Wall time of the whole optimizer step, seconds."""
    cpu_seconds: float = 0.0
    """CPU time of this process (all threads, user + system) during the step, seconds."""
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Seconds per phase: forward, backward (autograd), after_backward (strategy's gradient
    hand-off and overlapped optimizer work), optimizer (the step itself)."""


def _cpu_time() -> float:
    """User + system CPU seconds of this process, all threads."""
    t = os.times()
    return t.user + t.system


class StepTimer(pl.Callback):
    """Wall time of each optimizer step and of its phases, from Lightning's hooks.

    forward: batch start -> ``on_before_backward``; backward: -> ``on_after_backward``;
    after_backward: -> ``on_before_optimizer_step`` or the batch end (the strategy's
    gradient hand-off, and optimizer work it overlaps with backward); optimizer:
    ``on_before_optimizer_step`` -> batch end.
    """

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._current = StepRecord()
        self._step_start = 0.0
        self._mark = 0.0
        self._phase = "forward"
        self._cpu_start = 0.0

    def _advance(self, next_phase: str) -> None:
        now = time.perf_counter()
        self._current.phases[self._phase] += now - self._mark
        self._mark, self._phase = now, next_phase

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_start = time.perf_counter()
        self._cpu_start = _cpu_time()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark, self._phase = time.perf_counter(), "forward"

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._advance("backward")

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._advance("after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._advance("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._advance("forward")
        if trainer.global_step > len(self.steps):
            now = time.perf_counter()
            cpu = _cpu_time()
            self._current.seconds = now - self._step_start
            self._current.cpu_seconds = cpu - self._cpu_start
            self.steps.append(self._current)
            self._current, self._step_start, self._cpu_start = StepRecord(), now, cpu

    def timed(self, warmup: int) -> list[StepRecord]:
        """The records after the first ``warmup`` steps."""
        return self.steps[warmup:]


def summarize(records: list[StepRecord], tokens_per_step: int) -> tuple[float, float, str]:
    """(tokens/s, mean step seconds, phase breakdown line) over ``records``."""
    if not records:
        raise ValueError("no timed optimizer steps: raise --steps above 0")
    total = sum(r.seconds for r in records)
    mean = total / len(records)
    parts = []
    for phase in PHASES:
        s = sum(r.phases[phase] for r in records) / len(records)
        parts.append(f"{phase} {s:.2f} s ({100 * s / mean:.0f}%)")
    cpu = sum(r.cpu_seconds for r in records) / total / (os.cpu_count() or 1)
    parts.append(f"CPU busy {100 * cpu:.0f}% of {os.cpu_count()} cores")
    parts.append(f"load average {os.getloadavg()[0]:.1f}")
    return tokens_per_step * len(records) / total, mean, ", ".join(parts)


RSS_KINDS = ("RssAnon", "RssShmem", "RssFile")
"""The kinds of resident memory ``/proc/PID/status`` splits RSS into: anonymous (heap,
private mappings such as the store's arenas), shared memory (shared anonymous mappings,
tmpfs) and file-backed pages (code, mapped files)."""


def rss_by_kind() -> dict[str, int]:
    """Resident memory of this process by kind (:data:`RSS_KINDS`) and ``"total"``, bytes.

    From ``/proc/self/status`` (Linux); elsewhere every kind is 0 and the total is psutil's RSS.
    """
    out = dict.fromkeys(RSS_KINDS, 0)
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        return {**out, "total": rss()}
    return {**out, "total": sum(out.values())}


def _peaks(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, 0), v) for k, v in b.items()}


class RssSampler:
    """Peak resident memory of this process by kind, sampled on a thread every ``interval`` s.

    Each kind's peak (:func:`rss_by_kind`: RssAnon, RssShmem, RssFile and their sum,
    ``"total"``) is kept on its own, so a kind's peak may come from another sample than the
    total's; :attr:`at_peak` is the sample at the total's peak. ``accounts``, if given, is
    called with each sample and its byte counts (e.g. a store's own accounting) are kept
    beside the kinds, peaks and all.
    """

    def __init__(
        self, interval: float = 0.05, accounts: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.interval = interval
        self.accounts = accounts
        """Byte counts sampled with each sample (names other than the RSS kinds)."""
        self.peaks: dict[str, int] = {}
        """Highest sampled bytes of each kind since the start, whole run."""
        self.at_peak: dict[str, int] = {}
        """The sample (bytes by kind) at the highest total, whole run."""
        self.phases: dict[str, dict[str, int]] = {}
        """Highest sampled bytes of each kind within each marked phase (over every time the
        phase ran)."""
        self._current: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    @property
    def peak(self) -> int:
        """Highest sampled total RSS of the whole run, bytes."""
        return self.peaks.get("total", 0)

    def sample(self) -> dict[str, int]:
        """Take one sample now, fold it into the peaks, and return it (bytes by kind)."""
        now = rss_by_kind()
        if self.accounts is not None:
            now.update(self.accounts())
        with self._lock:
            if now["total"] >= self.at_peak.get("total", 0):
                self.at_peak = now
            self.peaks = _peaks(self.peaks, now)
            self._current = _peaks(self._current, now)
        return now

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def mark(self, label: str) -> None:
        """End a phase: its peaks so far (and now) go under ``label`` (kept as the highest
        over every time the phase ran); the next phase's peaks start from now."""
        now = self.sample()
        with self._lock:
            self.phases[label] = _peaks(self.phases.get(label, {}), self._current)
            self._current = dict(now)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def rss_line(sample: dict[str, int]) -> str:
    """``total X GiB (RssAnon a, RssShmem s, RssFile f)`` of a :class:`RssSampler` sample."""
    kinds = ", ".join(f"{k} {sample.get(k, 0) / GIB:.2f}" for k in RSS_KINDS)
    return f"{sample.get('total', 0) / GIB:.2f} GiB ({kinds})"


class PhaseMarker(pl.Callback):
    """Marks the phases of a fit on an :class:`RssSampler`: ``setup`` (to the training
    start: the model built, its tensors streamed into the store), then per micro-batch
    ``forward`` (to ``on_before_backward``), ``backward`` (to ``on_after_backward``) and
    ``optimizer`` (to the batch end: the strategy's gradient hand-off and the step)."""

    def __init__(self, sampler: RssSampler) -> None:
        self.sampler = sampler

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sampler.mark("setup")

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sampler.mark("forward")

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sampler.mark("backward")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sampler.mark("optimizer")


def quiet() -> None:
    """Silence Lightning's banner lines and warnings that do not concern the measurement."""
    import logging
    import warnings

    for name in (
        "lightning.pytorch",
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric",
        "lightning.fabric.utilities.rank_zero",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")


def rss() -> int:
    """Current resident set size of this process, bytes."""
    return int(psutil.Process().memory_info().rss)


def trim_heap() -> int:
    """Give the freed memory of this process's heap back to the system; its RSS after, bytes.

    The probes free what they allocated, but the allocator setting every run gets
    (:func:`~bb_lightning.engine.inference.keep_host_allocations`) keeps freed memory in the
    heap: 4 GiB after the 374M Llama's probes, held through every child's run. glibc's
    ``malloc_trim``; elsewhere nothing is released.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
    return rss()


def max_rss() -> int:
    """``ru_maxrss`` of this process, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def quiet_trainer(
    strategy: Any,
    *,
    steps: int,
    accumulate: int,
    callbacks: list[pl.Callback],
    precision: str = "bf16-true",
    **more: Any,
) -> pl.Trainer:
    """A CPU Trainer (``precision``, default bf16-true) running ``steps`` optimizer steps,
    without logging or saving; ``more`` adds or replaces Trainer arguments
    (``enable_checkpointing=True`` for a run that saves)."""
    args: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        **(args | more),
    )


def llama_config(args: Any) -> dict[str, Any]:
    """A Llama config dict (untied head, no GQA) from parsed ``--hidden/--ffn/--layers/--heads/--vocab/--seq``."""
    return {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(2048, args.seq),
        "tie_word_embeddings": False,
    }


@contextlib.contextmanager
def busy_neighbour(on: bool = True) -> Iterator[int | None]:
    """With ``on``: a subprocess spinning on one core of this process (the last one it may
    run on) while the block runs; yields that core, or None when off."""
    if not on:
        yield None
        return
    core = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.2)  # let it start spinning before the probe does
        yield core
    finally:
        proc.terminate()
        proc.wait()


def isolated(fn: Callable[..., R], *fn_args: Any) -> R:
    """``fn(*fn_args)`` in a child process of its own; its (picklable) result.

    Each timed run of a benchmark gets a fresh process, as a user's job does: nothing
    an earlier run allocated, cached or left fragmented in this process's heap (tens of
    GiB on a model of a few hundred million parameters) and no page-fault pattern it
    set up carries into the next run. On the 2-core VMs the order of two runs in one
    process moved their step times by 10-25 %. The children fork from a server that
    imported torch, Lightning, transformers and the library once, before any thread
    pool started; each child then runs the script's module level (its imports are
    already loaded), so module-level functions of the script pickle by name. An
    exception in ``fn`` is raised here; a child killed by the system raises
    ``BrokenProcessPool``.
    """
    ctx = multiprocessing.get_context("forkserver")
    # by name: Python 3.11's forkserver does not pass the script's path on to preload it
    ctx.set_forkserver_preload(["_common", "bb_lightning", "bb_lightning.module"])
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *fn_args).result()


def gib(nbytes: float) -> str:
    """``nbytes`` as GiB with two decimals."""
    return f"{nbytes / GIB:.2f} GiB"


def hf_generate(
    model: Any, prompts: torch.Tensor, batch: int, new: int, max_batches: int = 0
) -> tuple[float, list[list[int]]]:
    """(generated tokens/s, token ids per prompt) of Hugging Face's greedy ``generate`` of
    ``new`` tokens over ``prompts`` (``[n, length]`` token ids) ``batch`` at a time.

    With ``max_batches`` > 0 only the first ``max_batches`` batches run.
    """
    out: list[list[int]] = []
    starts = list(range(0, len(prompts), batch))
    start = time.perf_counter()
    with torch.inference_mode():
        for i in starts[:max_batches] if max_batches > 0 else starts:
            ids = prompts[i : i + batch]
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            out += gen[:, ids.shape[1] :].tolist()
    seconds = time.perf_counter() - start
    return sum(map(len, out)) / seconds, out


class PredictTimer(pl.Callback):
    """Seconds spent in predict batches (setup, weights to their tiers, teardown excluded),
    and this process's CPU seconds in them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self._t = self._cpu = 0.0

    def on_predict_batch_start(self, *args: Any) -> None:
        self._t, self._cpu = time.perf_counter(), _cpu_time()

    def on_predict_batch_end(self, *args: Any) -> None:
        self.seconds += time.perf_counter() - self._t
        self.cpu_seconds += _cpu_time() - self._cpu

    def busy(self) -> float:
        """Share of the machine's cores this process kept busy in the batches (0..1)."""
        return self.cpu_seconds / max(self.seconds * (os.cpu_count() or 1), 1e-9)


def cpu_training_engine(
    model: torch.nn.Module, placement: Placement, nvme: Path, *, io_threads: int = 2
) -> tuple[TrainingEngine, TieredStore]:
    """A training engine on the CPU over ``model``'s ``model.model.layers`` as blocks, with
    its store sized to what ``placement`` needs (1 MiB of NVMe spare) and its NVMe tier in
    directory ``nvme`` behind ``io_threads`` POSIX I/O threads. Close the store after use."""
    from bb_lightning.engine.budgets import required_budgets
    from bb_lightning.engine.trainer_engine import TrainingEngine
    from storage.io import IOConfig
    from storage.store import StoreConfig, TieredStore
    from storage.tiers import Tier

    blocks: Any = model.get_submodule("model.layers")
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    need = required_budgets(numels, rest, placement)
    store = TieredStore(
        StoreConfig(
            device_budget=need[Tier.DEVICE],
            host_budget=need[Tier.HOST],
            nvme_path=str(nvme),
            nvme_budget=need[Tier.NVME] + (1 << 20),
            io=IOConfig(backend="posix", threads=io_threads),
            device="cpu",
        )
    )
    try:
        engine = TrainingEngine(model, blocks, store, placement, device=torch.device("cpu"))
    except BaseException:
        store.close()
        raise
    return engine, store


def nvme_strategy(layers: int, nvme: Path) -> BalanceBeamStrategy:
    """A strategy computing in fp32 with every block's weights and fp32 state homed on the
    NVMe tier in directory ``nvme`` (one block read ahead): a run that reads and writes
    the disk at every step."""
    from bb_lightning.placement import Placement
    from bb_lightning.strategy.core import BalanceBeamStrategy
    from storage.tiers import Tier

    blocks = (Tier.NVME,) * layers
    return BalanceBeamStrategy(
        placement=Placement(weights=blocks, master=blocks, prefetch_depth=1),
        compute_dtype="fp32",
        nvme_path=str(nvme),
    )
