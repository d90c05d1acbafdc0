"""Runs of ``dp_run.py``: one process (in this one, through ``dp_run.main``), or several
ranks as a user launches them (``python dp_run.py --devices 2 ...``, Lightning's popen
launcher starting the other ranks), on gloo, each rank on one thread.

A training run is cached for the whole pytest run by its arguments, so that the tests
comparing it with another (equivalence, resume) share it; under pytest-xdist the workers
share one cache directory, and a run another worker started is waited for (a file lock)
and read, not run again; an attempt that failed before its record was written is moved
aside, so a run never starts in a directory another left half-written. Every launched
run gets a rendezvous store of its own, hosted by this process on a port the kernel
picked and kept bound (``TORCHELASTIC_USE_AGENT_STORE``: every rank connects to it, none
binds ``MASTER_PORT`` itself, so no other process can take the port between its choice
and its use), and a timeout; the launched process and the ranks it starts are one
process group, killed when the run ends, so a rank that hangs cannot outlive its test.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from ..bb_lightning.tiny import FAMILIES, tiny_llama_config

SCRIPT = Path(__file__).resolve().parent / "dp_run.py"
TIMEOUT = 180.0
"""Seconds a run may take (a few on 2 cores; a hang fails the test instead of the suite)."""

LLAMA = tiny_llama_config(2)
"""The trained model: a tiny Llama, 2 blocks of hidden 64, vocab 256 (dropout is 0)."""

PROMPT_LLAMA: dict[str, Any] = {
    **LLAMA,
    "vocab_size": 260,
    "max_position_embeddings": 48,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
"""The generating model: byte tokens plus pad 256, bos 257, eos 258."""

TIED_LLAMA = tiny_llama_config(2, tie_word_embeddings=True)
"""The trained model with its head tied to its embedding (one parameter, two uses)."""

MIXTRAL: dict[str, Any] = {
    **FAMILIES["mixtral_aux_loss"],
    "vocab_size": LLAMA["vocab_size"],
    "max_position_embeddings": LLAMA["max_position_embeddings"],
}
"""A mixture of experts (4 experts, 2 per token, the routers' auxiliary loss in the loss)
with the trained model's vocabulary."""


@contextmanager
def rendezvous(timeout: float) -> Iterator[dict[str, str]]:
    """The environment that points a run's ranks at a rendezvous store hosted here, for
    ``timeout`` seconds at most: a ``TCPStore`` server on a port the kernel picks and that
    stays bound while the run lasts. With ``TORCHELASTIC_USE_AGENT_STORE`` every rank,
    rank 0 included, connects to it as a client (``torch.distributed.rendezvous``), so no
    rank binds ``MASTER_PORT``, which another process could have taken meanwhile."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    finally:
        del store


@dataclass
class Run:
    """A finished run of ``dp_run.py``: its exit status, output and result files."""

    out: Path
    returncode: int
    stdout: str
    stderr: str
    argv: list[str] = field(default_factory=list)

    def check(self) -> Run:
        """This run, after asserting that it succeeded."""
        assert self.returncode == 0, f"{self.argv}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        return self

    def losses(self) -> dict[int, list[float]]:
        """Each step's micro-batch losses, every rank's, by step index."""
        by_step: dict[int, list[float]] = {}
        for path in sorted(self.out.glob("losses.rank*.json")):
            for _rank, step, value in json.loads(path.read_text()):
                by_step.setdefault(int(step), []).append(float(value))
        return by_step

    def loss_files(self) -> list[str]:
        return sorted(p.name for p in self.out.glob("losses.rank*.json"))

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Masters and AdamW moments by kind and name, as rank 0 read them with zarr."""
        return torch.load(self.out / "state.pt", weights_only=True)

    def result(self) -> dict[str, Any]:
        return json.loads((self.out / "result.json").read_text())

    def seen(self) -> dict[int, list[str]]:
        """The prompt ids each rank generated, by rank."""
        return {
            int(p.name.split(".")[1][4:]): json.loads(p.read_text())
            for p in sorted(self.out.glob("seen.rank*.json"))
        }


def launch(out: Path, *args: str, timeout: float = TIMEOUT) -> Run:
    """Run ``dp_run.py --out out ARGS`` in a new process group, its ranks meeting at a
    rendezvous store of their own (:func:`rendezvous`)."""
    with rendezvous(timeout) as meeting:
        return _launch(out, dict(os.environ, **meeting), list(args), timeout)


def _launch(out: Path, env: dict[str, str], args: list[str], timeout: float) -> Run:
    env["OMP_NUM_THREADS"] = "1"
    for key in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    argv = [sys.executable, str(SCRIPT), *args, "--out", str(out)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{argv} ran over {timeout} s (a rank hangs):\n{stderr[-6000:]}")
    finally:
        try:  # the other ranks, should the launching rank have left them behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Run(out, proc.returncode, stdout, stderr, argv)


def in_process(out: Path, *args: str) -> Run:
    """``dp_run.main([*args, "--out", out])`` in this process (one rank only)."""
    spec = importlib.util.spec_from_file_location("dp_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    try:
        script.main([*args, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return Run(out, 0, "", "", list(args))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (made if missing), across processes."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _once(out: Path, run: Callable[[], Run]) -> Run:
    """``run()``'s result for the run directory ``out``, run by whichever process of this
    pytest run asks first; the others wait for it and read its record (``run.json``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = out / "run.json"
    with _locked(out.parent / f"{out.name}.lock"):
        if not record.exists():
            if out.exists():  # an attempt that failed: kept for its files, out of the way
                out.rename(out.with_name(f"{out.name}.failed-{os.getpid()}-{time.time_ns()}"))
            done = run()
            out.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({**asdict(done), "out": str(done.out)}))
    fields = json.loads(record.read_text())
    return Run(**{**fields, "out": Path(fields["out"])})


class Runs:
    """Runs of ``dp_run.py``: training runs cached under ``shared`` (every xdist
    worker's), keyed by their arguments; the others into directories their callers make
    afresh (``tmp_path``), so that a fixture built again never meets its last build's
    files."""

    def __init__(self, shared: Path, model: Path, prompt_model: Path) -> None:
        self.shared = shared
        self.model = model
        self.prompt_model = prompt_model
        self.tied_model = model.with_name("tied-llama")
        """:data:`TIED_LLAMA`'s ``save_pretrained`` directory (pass ``--model`` it)."""
        self.moe_model = model.with_name("mixtral")
        """:data:`MIXTRAL`'s ``save_pretrained`` directory (pass ``--model`` it)."""

    def fit(self, devices: int, accum: int, *args: str) -> Run:
        """A (cached) training run of the tiny Llama at ``devices`` ranks; checked.

        One process runs in this one, through ``dp_run.main`` (no interpreter start).
        """
        key = json.dumps(["fit", devices, accum, *args])
        out = self.shared / f"fit-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
        argv = ["--devices", str(devices), "--accum", str(accum), "--model", str(self.model)]
        argv += args

        def run() -> Run:
            extra: list[str] = []
            if "--tier" in args and args[args.index("--tier") + 1] == "nvme":
                out.mkdir(parents=True, exist_ok=True)  # the run makes the NVMe directory
                extra = ["--nvme-path", str(out / "nvme")]
            if devices == 1:
                return in_process(out, *argv, *extra)
            return launch(out, *argv, *extra).check()

        return _once(out, run)

    def predict(self, out: Path, devices: int, prompts: Path, predictions: Path) -> Run:
        """A predict run of the generating model at ``devices`` ranks (one: in this
        process), writing its files under ``out``; checked."""
        argv = ["--devices", str(devices), "--model", str(self.prompt_model)]
        argv += ["--predict", str(prompts), "--predictions", str(predictions)]
        if devices == 1:
            return in_process(out, *argv)
        return launch(out, *argv).check()

    def unchecked(self, out: Path, *args: str) -> Run:
        """A training run of the tiny Llama writing under ``out`` that may fail (its exit
        status is the result)."""
        return launch(out, "--model", str(self.model), *args, timeout=120)


def _save(config: dict[str, Any], path: Path, seed: int) -> Path:
    cfg = dict(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The runs of this pytest run, over tiny models written with ``save_pretrained``
    (once, into the directory every xdist worker shares)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "dp-shared"
    models = shared / "models"
    models.mkdir(parents=True, exist_ok=True)
    with _locked(shared / "models.lock"):
        made = (
            ("llama", LLAMA, 0),
            ("prompt-llama", PROMPT_LLAMA, 3),
            ("tied-llama", TIED_LLAMA, 5),
            ("mixtral", MIXTRAL, 7),
        )
        for name, config, seed in made:
            if not (models / name / "config.json").exists():
                _save(config, models / name, seed)
    return Runs(shared, models / "llama", models / "prompt-llama")
