"""The checks of a first run on a GPU machine, one function per step (``scripts/gpu-check.sh``).

Each step runs in its own process under its own time limit (the shell script is the
driver) and writes ``OUTDIR/steps/<step>.json``: ``{"step", "pass", "skipped",
"figures", "seconds"}``, where ``pass`` is true, false, or null (nothing to judge:
skipped, or a dry run's figures). ``--collect`` merges them into
``OUTDIR/gpu-check.json``; a step that left no file (killed at its limit) is a failure.

``--dry-run`` runs the Python of every step on the CPU at tiny sizes; what needs CUDA
(kvikio, Lightning's FSDP, DeepSpeed) is skipped with the reason recorded.

Usage: ``python bench/gpu_check.py OUTDIR --step NAME [--dry-run]``, ``--list``
(``name seconds`` per step), ``--collect [--only a,b]``. The NVMe directory is
``$BB_NVME_DIR`` (the driver makes a fresh one and removes it), else a folder under the
system's temporary directory; never OUTDIR, whose files come back from the machine.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
DRY_PROBE_S = 0.5
"""Seconds of every hardware probe of a dry run (the measure step's and the runs')."""


@dataclass
class Ctx:
    """Where a step writes, and at what size it runs."""

    out: Path
    dry: bool
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return torch.cuda.is_available() and not self.dry

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )

    @property
    def nvme(self) -> Path:
        path = Path(os.environ.get("BB_NVME_DIR") or Path(tempfile.gettempdir()) / "bb-gpu-check")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def probe_s(self, seconds: float) -> float:
        """Seconds a hardware probe may take: ``seconds``, or :data:`DRY_PROBE_S` in a dry
        run (whose tiny runs need the probe's code path, not its accuracy)."""
        return DRY_PROBE_S if self.dry else seconds


@dataclass
class Outcome:
    """What a step found: pass (None: nothing to judge) and why it was skipped, if it was."""

    passed: bool | None
    skipped: str | None = None


# -------------------------------------------------------------------- steps


def preflight_step(ctx: Ctx) -> Outcome:
    """Install the carried wheels the machine lacks, then import every module the steps
    need (``gpu_check_preflight``). Pass: each required module imports; judged in a dry
    run too, since a missing module is as missing on the CPU."""
    from gpu_check_preflight import preflight

    return Outcome(preflight(ctx.figures, torch.version.cuda))


def versions(ctx: Ctx) -> Outcome:
    """Versions, the GPU, and kvikio's settings. Pass: CUDA is available."""
    from importlib.metadata import version

    from storage.io import kvikio_status

    f = ctx.figures
    f.update(python=platform.python_version(), torch=torch.__version__,
             torch_cuda=torch.version.cuda, lightning=version("lightning"),
             transformers=version("transformers"), cuda_available=torch.cuda.is_available())  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        f.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                 gpus=torch.cuda.device_count())  # fmt: skip
    usable, why = kvikio_status()
    f["kvikio"] = why
    if usable:
        import kvikio.defaults as kd

        f["kvikio_compat_mode"] = str(_kvikio_get(kd, "compat_mode"))
        f["kvikio_num_threads"] = _kvikio_get(kd, "num_threads")
    if ctx.dry:
        return Outcome(None, "dry run: CUDA not used")
    return Outcome(torch.cuda.is_available())


def pytest_gpu(ctx: Ctx) -> Outcome:
    """``pytest -m "gpu or kvikio"``. Pass: no failures and no errors."""
    # only the files that hold such tests: collecting the others imports what the GPU
    # machine may lack (hypothesis, peft); a dry run selects from one file without
    # Lightning (its kvikio tests are skipped)
    targets = ["tests/storage/test_io.py"] if ctx.dry else gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or kvikio",
           "--junitxml", str(ctx.out / "pytest-gpu.xml"), *targets]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    tail = (done.stdout + done.stderr)[-4000:]
    print(tail)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}
    ctx.figures.update(returncode=done.returncode, **counts)
    ok = done.returncode == 0 and not counts.get("failed") and not counts.get("errors")
    return Outcome(None if ctx.dry else ok)


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu`` or ``kvikio``, relative to the repository."""
    marks = ("pytest.mark.gpu", "pytest.mark.kvikio")
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if any(mark in path.read_text(errors="replace") for mark in marks)
    )


def page_in(ctx: Ctx) -> Outcome:
    """Host (pinned) -> device page-in through the store against a raw pinned ``copy_`` of
    the same bytes. Pass: ratio >= 0.9."""
    from storage.store import StoreConfig, TieredStore
    from storage.tiers import Tier

    nbytes = (8 << 20) if ctx.dry else GIB
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    store = TieredStore(StoreConfig(device_budget=nbytes + (64 << 20),
                                    host_budget=nbytes + (512 << 20), device=str(ctx.device)))  # fmt: skip
    try:
        store.register("x", src, home=Tier.HOST)
        ours, same = [], True
        for _ in range(5):
            ctx.sync()
            t0 = time.perf_counter()
            got = store.prefetch_async(["x"]).wait()["x"]
            ctx.sync()
            ours.append(time.perf_counter() - t0)
            same &= bool(torch.equal(got.view(torch.uint8)[:nbytes].cpu(), src))
            store.release(["x"])
    finally:
        store.close()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda).copy_(src)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    raw = []
    for _ in range(5):
        ctx.sync()
        t0 = time.perf_counter()
        dst.copy_(pinned, non_blocking=True)
        ctx.sync()
        raw.append(time.perf_counter() - t0)
    ratio = min(raw) / min(ours)
    ctx.figures.update(bytes=nbytes, store_gb_s=nbytes / min(ours) / 1e9,
                       raw_copy_gb_s=nbytes / min(raw) / 1e9, ratio=ratio, bytes_equal=same)  # fmt: skip
    return Outcome(None if ctx.dry else (same and ratio >= 0.9))


def nvme_read(ctx: Ctx) -> Outcome:
    """NVMe -> device: kvikio straight into device memory against POSIX reads into pinned
    memory then a copy, with 1 and 8 threads, cold page cache. Pass: bytes equal."""
    from storage.io import (
        IOConfig,
        KvikioBackend,
        PosixBackend,
        aligned_empty,
        drop_cache,
        kvikio_status,
    )

    nbytes = (8 << 20) if ctx.dry else GIB
    path = ctx.nvme / "gpu-check.bin"
    src = aligned_empty(nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    with PosixBackend(IOConfig(backend="posix")) as io:
        io.write_async(path, src, nbytes).wait()
    f, ok = ctx.figures, True
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    usable, why = kvikio_status()
    for threads in (1, 8):
        drop_cache(path)
        pinned = aligned_empty(nbytes, pin=ctx.cuda)
        with PosixBackend(IOConfig(backend="posix", threads=threads)) as io:
            t0 = time.perf_counter()
            io.read_async(path, pinned, nbytes).wait()
            dst.copy_(pinned[:nbytes], non_blocking=True)
            ctx.sync()
            f[f"posix_pinned_device_{threads}t_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
        ok &= bool(torch.equal(dst.cpu(), src[:nbytes]))
        if not (ctx.cuda and usable):
            continue
        import kvikio.defaults as kd

        _kvikio_set(kd, "num_threads", threads)
        drop_cache(path)
        dst.zero_()
        with KvikioBackend(IOConfig(backend="kvikio", threads=threads)) as io:
            t0 = time.perf_counter()
            io.read_async(path, dst, nbytes).wait()
            ctx.sync()
            f[f"kvikio_device_{threads}t_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
        ok &= bool(torch.equal(dst.cpu(), src[:nbytes]))
    path.unlink()
    f.update(bytes=nbytes, bytes_equal=ok)
    skipped = None
    if not ctx.cuda:
        skipped = "kvikio not run: needs CUDA" + (" (dry run)" if ctx.dry else "")
    elif not usable:
        skipped = f"kvikio not run: {why}"
    return Outcome(None if ctx.dry else ok, skipped)


def measure_step(ctx: Ctx) -> Outcome:
    """``measure(cache=False)``. Pass: under 30 s, h2d >= 20 GB/s, >= 400 TFLOP/s."""
    from bb_lightning.probe import measure

    os.environ["BB_CACHE_DIR"] = str(ctx.out / "cache")
    t0 = time.perf_counter()
    hw = measure(nvme_path=str(ctx.nvme), cache=False, max_seconds=ctx.probe_s(15.0))
    took = time.perf_counter() - t0
    ctx.figures.update(seconds=took, profile=hw.to_dict())
    if ctx.dry:
        return Outcome(None)
    return Outcome(took < 30 and hw.h2d_bandwidth >= 20e9 and hw.device_flops >= 400e12)


def compile_step(ctx: Ctx) -> Outcome:
    """A paged block's forward eager against compiled as ``compile_blocks="inductor"``
    runs it (``gpu_check_compile.py``: a Llama-7B-shaped bf16 block, 2,048 tokens; a dry
    run, a tiny fp32 block under ``aot_eager``). Pass: outputs and input gradients within
    0.1 of eager's; the ratio decides whether to turn ``compile_blocks`` on, not a pass."""
    from gpu_check_compile import eager_and_compiled

    ctx.figures.update(eager_and_compiled(ctx.device, dry=ctx.dry, sync=ctx.sync))
    return Outcome(None if ctx.dry else ctx.figures["max_abs_diff"] < 0.1)


MUST_PAGE: dict[str, Any] = {
    "name": "llama-3.2-3b-shape", "hidden": 3072, "ffn": 8192, "layers": 28, "heads": 24,
    "kv_heads": 8, "vocab": 128256, "seq": 2048, "micro": 1, "accum": 2, "steps": 3,
    "device_cap_gib": 6.5,
}  # fmt: skip
"""The fine-tune's model: Llama 3.2 3B's published shape (3.61 B parameters, 6.7 GiB of
bf16 weights, a 128k vocabulary, untied head), with device memory capped below its
weights (6.5 GiB) so that it must page. Planned on an H200 preset so capped, it pages
every block at micro-batch 1 (4.78 GiB planned of a 4.85 GiB budget) and its dry run
peaks at 4.51 GiB on the device; at a 6 GiB cap no micro-batch fits."""
LARGEST = 1
"""How far up the predict step's ladder it may go (1: its first entry): building a
larger model with random weights on the host, twice, outlasts the step's limit."""
HOST_BYTES_PER_PARAM = 24
"""Host bytes per parameter of a full fine-tune with host-side AdamW (fp32 model as
built, master, two moments, gradient accumulator, bf16 weights)."""


def finetune(ctx: Ctx) -> Outcome:
    """Full fine-tuning of a model that must page (:data:`MUST_PAGE`: weights larger than
    the device cap, a 128k vocabulary), random weights: tokens/s and MFU of
    ``balance_beam``, of Lightning's FSDP with CPU offload and (if it imports) DeepSpeed
    ZeRO-3 offload, same model, data and batch, and their losses. Pass: ``balance_beam``
    ran."""
    import psutil

    start = time.perf_counter()

    if ctx.dry:
        spec: dict[str, Any] = {"name": "tiny", "hidden": 64, "ffn": 128, "layers": 2,
                                "heads": 4, "kv_heads": 2, "vocab": 1024, "seq": 32,
                                "micro": 2, "accum": 2, "steps": 2, "device_cap_gib": 24.0}  # fmt: skip
    else:
        spec = dict(MUST_PAGE)
    spec["params"] = _llama_params(spec)
    spec["weights_bytes"] = 2 * spec["params"]  # bf16
    spec["must_page"] = spec["weights_bytes"] > spec["device_cap_gib"] * GIB
    spec["host_bytes_needed"] = spec["params"] * HOST_BYTES_PER_PARAM
    spec["host_bytes_available"] = psutil.virtual_memory().available
    ctx.figures["model"] = spec
    runs: dict[str, Any] = {}
    frameworks = ["balance_beam", "fsdp_cpu_offload", "deepspeed_zero3_offload"]
    able = [f for f in frameworks if _cannot_run(f, ctx) is None]
    for framework in frameworks:
        why = _cannot_run(framework, ctx)
        if why is not None:
            runs[framework] = {"skipped": why}
            continue
        # the step's time left, shared by the runs still to come (5 s kept for the JSON)
        left = STEPS["finetune"][1] - 5 - (time.perf_counter() - start)
        limit = max(1, int(left / (len(able) - able.index(framework))))
        runs[framework] = run = _in_subprocess(ctx, "train", framework, spec, limit=limit)
        left = STEPS["finetune"][1] - 5 - (time.perf_counter() - start)
        after = len(able) - able.index(framework) - 1
        if run.get("oom") and left > 30 * (after + 1):  # again, recording what held memory
            retry = {**spec, "record_memory_history": True}
            run["oom_retry"] = _in_subprocess(ctx, "train", framework, retry,
                                              limit=int(left / (after + 1)))  # fmt: skip
    ctx.figures["runs"] = runs
    compare_runs(ctx, runs)
    ran = "tokens_per_s" in runs["balance_beam"]
    return Outcome(None if ctx.dry else ran)


def compare_runs(ctx: Ctx, runs: dict[str, Any]) -> None:
    """Each peer's throughput over ``balance_beam``'s, the MFU of each run against the
    matrix-product rate the measure step measured, and how far each peer's loss per
    micro-batch is from ``balance_beam``'s on the same data and initial weights."""
    measured = ctx.out / "steps" / "measure.json"
    flops_rate = None
    if measured.is_file():
        flops_rate = (
            json.loads(measured.read_text())["figures"].get("profile", {}).get("device_flops")
        )
    ctx.figures["measured_device_flops"] = flops_rate
    ours = runs["balance_beam"]
    for k, r in runs.items():
        if "tokens_per_s" in r and flops_rate:
            r["mfu_measured"] = r["tokens_per_s"] * r["model_flops_per_token"] / flops_rate
        if k == "balance_beam" or "tokens_per_s" not in r or "tokens_per_s" not in ours:
            continue
        ctx.figures[f"ratio_balance_beam_over_{k}"] = ours["tokens_per_s"] / r["tokens_per_s"]
        pairs = list(zip(ours.get("losses", []), r.get("losses", []), strict=False))
        if pairs:
            ctx.figures[f"loss_max_rel_diff_{k}"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in pairs
            )


OPTS = [  # (name, hidden, ffn, layers, heads): published OPT shapes
    ("opt-6.7b", 4096, 16384, 32, 32),
    ("opt-13b", 5120, 20480, 40, 40),
]


def predict(ctx: Ctx) -> Outcome:
    """Bulk greedy generation of an OPT-shaped model (random weights) with device memory
    capped at 16 GiB: ``balance_beam``'s engine against Accelerate's CPU offload
    (``dispatch_model``), and the share of prompts with the same tokens. Pass: both ran."""
    import psutil

    if ctx.dry:
        spec: dict[str, Any] = {"name": "tiny", "hidden": 64, "ffn": 128, "layers": 2,
                                "heads": 4, "prompts": 4, "prompt_len": 16, "new": 4}  # fmt: skip
    else:
        room = 0.35 * psutil.virtual_memory().available  # bf16 weights, pinned copy, slack
        fits = [s for s in OPTS if 2 * 12 * s[1] ** 2 * s[3] <= room]
        name, hidden, ffn, layers, heads = (fits or OPTS[:1])[min(len(fits), LARGEST) - 1]
        spec = {"name": name, "hidden": hidden, "ffn": ffn, "layers": layers, "heads": heads,
                "prompts": 16, "prompt_len": 128, "new": 8}  # fmt: skip
    ctx.figures["model"] = spec
    result = _in_subprocess(ctx, "predict", "both", spec, limit=STEPS["predict"][1] - 5)
    ctx.figures.update(result)
    # random weights give near-ties that bf16 rounding may flip: agreement is a figure
    ok = "same_tokens" in result
    return Outcome(None if ctx.dry else ok)


def data_parallel(ctx: Ctx) -> Outcome:
    """One rank on one GPU through the data-parallel engine (``gpu_check_dp.py``): a world
    of one rank, the blocks assembled at page-in and their gradients reduce-scattered on
    the device over NCCL. Pass: the group's backend holds NCCL and the weights after two
    steps lie within 1e-4 of ``torch.optim.AdamW``'s on the CPU."""
    from gpu_check_dp import one_rank

    ctx.figures.update(one_rank(ctx.device))
    ctx.figures["several_gpus"] = "not run"
    ok = ctx.figures["max_abs_diff"] < 1e-4 and "nccl" in ctx.figures["backend"]
    return Outcome(None if ctx.dry else ok)


STEPS: dict[str, tuple[Callable[[Ctx], Outcome], int]] = {
    "preflight": (preflight_step, 25),
    "versions": (versions, 10),
    "pytest": (pytest_gpu, 35),
    "page_in": (page_in, 15),
    "nvme_read": (nvme_read, 15),
    "measure": (measure_step, 25),
    "compile": (compile_step, 25),
    "finetune": (finetune, 100),
    "predict": (predict, 65),
    "data_parallel": (data_parallel, 15),
}
"""Step name -> (function, seconds the driver allows it): 330 s in all, so that one call
of 6 minutes holds the whole check with the driver's own seconds."""
TOTAL_LIMIT_S = 330
"""The most the steps' limits may sum to."""


# -------------------------------------------------------------------- child runs


def _in_subprocess(ctx: Ctx, kind: str, framework: str, spec: dict[str, Any], limit: int) -> Any:
    """Run one framework in a fresh process (device memory, process groups and allocator
    caches do not leak into the next); its last output line is its result JSON."""
    cmd = [sys.executable, __file__, str(ctx.out), "--child", kind, framework, json.dumps(spec),
           "--dump-after", str(max(1, limit - 5))]  # fmt: skip
    if ctx.dry:
        cmd.append("--dry-run")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as err:
        print(_text(err.stdout)[-3000:], _text(err.stderr)[-6000:])  # stderr: the stacks
        return {"error": f"timed out after {limit} s"}
    print(done.stdout[-3000:], done.stderr[-3000:])
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-500:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _text(out: str | bytes | None) -> str:
    """A timed-out child's output (bytes even under ``text=True``) as text."""
    if isinstance(out, bytes):
        return out.decode(errors="replace")
    return out or ""


def _cannot_run(framework: str, ctx: Ctx) -> str | None:
    if framework == "balance_beam":
        return None
    if not ctx.cuda:
        return "needs CUDA (dry run)" if ctx.dry else "needs CUDA"
    if framework == "deepspeed_zero3_offload":
        try:
            import deepspeed  # noqa: F401
        except Exception as err:
            return f"deepspeed does not import: {err!r}"
    return None


def _llama_params(spec: dict[str, Any]) -> int:
    """Parameters of a Llama of ``spec``'s shape with an untied head."""
    hidden, kv = spec["hidden"], spec["hidden"] * spec["kv_heads"] // spec["heads"]
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * spec["ffn"] + 2 * hidden
    return spec["layers"] * block + 2 * spec["vocab"] * hidden + hidden


# -------------------------------------------------------------------- driver


def _kvikio_get(kd: Any, key: str) -> Any:
    if hasattr(kd, "get"):
        return kd.get(key)
    return getattr(kd, key)()  # kvikio < 25.02: defaults.num_threads()


def _kvikio_set(kd: Any, key: str, value: Any) -> None:
    """``kvikio.defaults.set(key, value)`` (kvikio >= 25.02; older: ``<key>_reset``)."""
    if not hasattr(kd, "set"):
        getattr(kd, f"{key}_reset")(value)
        return
    try:
        kd.set(key, value)
    except TypeError:
        kd.set({key: value})
    assert _kvikio_get(kd, key) == value, f"kvikio {key} stays {_kvikio_get(kd, key)}"


def run_step(name: str, ctx: Ctx) -> dict[str, Any]:
    """Run step ``name`` and write its JSON; a raised error is a failure, recorded."""
    fn, limit = STEPS[name]
    t0 = time.perf_counter()
    try:
        outcome = fn(ctx)
    except Exception as err:
        import traceback

        traceback.print_exc()
        outcome = Outcome(False)
        ctx.figures["error"] = f"{type(err).__name__}: {err}"
    record = {"step": name, "pass": outcome.passed, "skipped": outcome.skipped,
              "figures": ctx.figures, "seconds": time.perf_counter() - t0, "limit_s": limit,
              "dry_run": ctx.dry}  # fmt: skip
    path = ctx.out / "steps" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"[{name}] pass={outcome.passed} skipped={outcome.skipped} "
          f"in {record['seconds']:.1f} s")  # fmt: skip
    return record


def collect(out: Path, dry: bool, only: list[str] | None = None) -> dict[str, Any]:
    """Merge every step's JSON (of those in ``only``, if given) into
    ``out/gpu-check.json``; a missing one failed (killed, or not run after a failed
    preflight)."""
    steps = {}
    for name, (_, limit) in STEPS.items():
        if only is not None and name not in only:
            continue
        path = out / "steps" / f"{name}.json"
        if path.is_file():
            steps[name] = json.loads(path.read_text())
        else:
            steps[name] = {"step": name, "pass": False, "skipped": None, "figures": {},
                           "error": f"no result: killed at its limit of {limit} s, crashed, "
                                    "or not run after a failed preflight"}  # fmt: skip
    verdicts = [s["pass"] for s in steps.values()]
    summary = {"dry_run": dry, "all_passed": all(v is not False for v in verdicts),
               "failed": [k for k, s in steps.items() if s["pass"] is False], "steps": steps}  # fmt: skip
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--step", choices=sorted(STEPS))
    parser.add_argument("--list", action="store_true", help="print 'name seconds' per step")
    parser.add_argument("--collect", action="store_true")
    parser.add_argument("--only", help="with --collect: the steps run, comma-separated")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "FRAMEWORK", "SPEC"))
    parser.add_argument("--dump-after", type=float, default=0.0,
                        help="a child prints every thread's stack after this many seconds")  # fmt: skip
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, limit) in STEPS.items():
            print(name, limit)
        return 0
    if args.out is None:
        parser.error("OUTDIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out=args.out, dry=args.dry_run)
    if args.child:
        from gpu_check_runs import predict_child, train_child  # bench/ is on sys.path

        if args.dump_after > 0:  # where a child that outlasts its limit was
            faulthandler.dump_traceback_later(args.dump_after, exit=False)
        kind, framework, spec = args.child
        if kind == "train":
            result = train_child(ctx, framework, json.loads(spec))
        else:
            result = predict_child(ctx, json.loads(spec))
        print("RESULT " + json.dumps(result, default=str))
        return 0
    if args.collect:
        only = [s for s in args.only.split(",") if s] if args.only else None
        summary = collect(args.out, args.dry_run, only)
        print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
        return 0 if summary["all_passed"] else 1
    if args.step is None:
        parser.error("give --step NAME, --list or --collect")
    run_step(args.step, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
