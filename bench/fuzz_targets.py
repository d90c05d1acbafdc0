"""The input surfaces of ``bb-lightning`` as fuzz targets (shared by ``bench/fuzz.py`` and the
CI slice ``tests/bench/test_fuzz.py``).

Each :class:`Surface` has a valid seed directory (a tiny model written by
``save_pretrained``, a store written by ``convert_checkpoint``, a checkpoint written by the
checkpoint writer, a prompts file, a recipe), a mutator drawing changes to a copy of it
(:mod:`fuzz_mutate`) and entry points run on the copy. The contract every entry point keeps,
checked by :func:`run_case`: it either succeeds, or raises ``ValueError`` / ``OSError`` /
``NvmeError`` (what ``bb-lightning`` turns into one line and exit 2) whose first line names
the damaged directory or file; it never raises anything else, never runs past
:data:`CASE_SECONDS`, and never changes a byte of an input it only reads. Any breach is a
:class:`Crash`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fuzz_mutate as mut  # its neighbour: bench/ is on sys.path (the script's folder)
import torch
from hypothesis import strategies as st

CASE_SECONDS = 30.0
"""Longest one input may run (seconds) before it counts as a hang."""

MARK = "fuzzin"
"""Name of the directory each case runs on: a refusal's first line must contain it."""


class Crash(Exception):
    """An input that breached the contract; ``key`` is (exception type, file:line)."""

    def __init__(self, key: tuple[str, str], detail: str) -> None:
        super().__init__(detail)
        self.key = key


class _Hang(BaseException):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Hang


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (what a read-only entry point
    must leave as it found it)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame of ours (bb_lightning, storage) in ``exc``'s traceback,
    else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/bb_lightning/" in f.filename or "/storage/" in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"


# -- seeds ---------------------------------------------------------------------------------

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
"""The seed model: a 2-block, width-16 Llama."""


def _tiny_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_CONFIG))


def seed_model_dir(root: Path) -> Path:
    """A tiny Llama written by ``save_pretrained`` (config.json, model.safetensors)."""
    out = root / "model"
    if not (out / "config.json").is_file():
        _tiny_model().save_pretrained(out)
    return out


def seed_store(root: Path) -> Path:
    """The seed model converted into an NVMe-tier store by ``convert_checkpoint``."""
    from bb_lightning.hf.convert import convert_checkpoint
    from storage.io import IOConfig

    out = root / "store"
    if not (out / "zarr.json").is_file():
        convert_checkpoint(seed_model_dir(root), out, io=IOConfig(backend="posix"), progress=False)
    return out


def seed_checkpoint(root: Path) -> Path:
    """A checkpoint of a training engine over the seed model (weights on NVMe, state on the
    host), written by the checkpoint writer with a Lightning-like trainer state."""
    out = root / "ckpt"
    if (out / "meta.json").is_file():
        return out
    from _common import cpu_training_engine

    from bb_lightning.engine import checkpoint as ckpt
    from bb_lightning.placement import Placement
    from storage.tiers import Tier

    root.mkdir(parents=True, exist_ok=True)
    model = _tiny_model()
    layers = len(model.model.layers)
    placement = Placement(
        weights=(Tier.NVME,) * layers,
        master=(Tier.HOST,) * layers,
        prefetch_depth=1,
        compute_dtype="float32",
    )
    engine, store = cpu_training_engine(model, placement, root / "ckpt-scratch", io_threads=1)
    try:
        state = {
            "epoch": 0,
            "global_step": 1,
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
            "callbacks": {"ModelCheckpoint{}": {"best_model_score": torch.tensor(0.5)}},
            "lr_schedulers": [{"last_epoch": 1, "_last_lr": [1e-3]}],
            "hyper_parameters": {"learning_rate": 1e-3, "betas": (0.9, 0.95)},
            "state_dict": dict(model.state_dict()),
        }
        ckpt.save_checkpoint(engine, out, state)
    finally:
        store.close()
    shutil.rmtree(root / "ckpt-scratch", ignore_errors=True)
    return out


# -- entry points --------------------------------------------------------------------------


def _cli(argv: list[str]) -> None:
    """``bb-lightning argv``: exit 0 or 1 (verify's problems) pass; exit 2 raises the one line
    as a ValueError (so that :func:`run_case` checks it); anything else propagates."""
    from bb_lightning.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    if code == 2:
        raise ValueError(err.getvalue().strip())
    if code not in (0, 1):
        raise RuntimeError(f"exit {code}: {err.getvalue().strip()}")


def model_dir_entries(case: Path, scratch: Path) -> None:
    """Every reader of a model directory: the plan, the streaming reader, convert."""
    from bb_lightning.engine.hf_quirks import resolve_model
    from bb_lightning.hf.hf_load import HFCheckpoint, empty_model

    before = tree_digest(case)
    for entry in (
        lambda: _cli(["plan", "--model", str(case), "--hardware", "a100-80gb", "--json"]),
        lambda: _read_all(HFCheckpoint, empty_model, resolve_model, case),
        lambda: _cli(["convert", str(case), str(scratch / "converted"), "--no-progress"]),
    ):
        _expect(entry, case)
    _unchanged(case, before)


def _read_all(checkpoint: Any, empty: Any, resolve: Any, case: Path) -> None:
    resolved = resolve(case)
    model = empty(resolved.config)
    reader = checkpoint(case, model)
    for name, _ in model.named_parameters():
        reader.get(name)


def store_entries(case: Path, scratch: Path) -> None:
    """``bb-lightning verify``, the store as a model source (its config and every weight
    read, as ``CausalLMModule(store)`` reads them), and convert resuming into it (then the
    store must verify clean)."""
    from bb_lightning.hf.converted import converted_store, load_converted, store_config
    from storage.verify import verify_group

    before = tree_digest(case)

    def load() -> None:
        store = converted_store(case)
        if store is not None:
            load_converted(store, store_config(store))

    _expect(lambda: _cli(["verify", str(case)]), case)
    _expect(load, case)
    _unchanged(case, before)
    source = scratch.parent / "seeds" / "model"
    if _expect(lambda: _cli(["convert", str(source), str(case), "--no-progress"]), case):
        report = verify_group(case)
        if report.problems:
            raise Crash(("half-written", "convert"), report.problems[0])


def checkpoint_entries(case: Path, scratch: Path) -> None:
    """``bb-lightning verify`` and ``export`` of a checkpoint, and Lightning's load of it
    (every tensor of its state dict read)."""
    from bb_lightning.engine.checkpoint import load_checkpoint

    before = tree_digest(case)

    def load() -> None:
        state = load_checkpoint(case)
        for key in state["state_dict"]:
            state["state_dict"][key]

    out = scratch / "exported"
    _expect(lambda: _cli(["verify", str(case)]), case)
    _expect(load, case)
    if not _expect(lambda: _cli(["export", str(case), str(out), "--dtype", "fp32"]), case):
        left = sorted(p.name for p in out.rglob("*")) if out.is_dir() else []
        if left:
            raise Crash(("half-written", "export"), f"a refused export left {left[:5]}")
    _unchanged(case, before)


def _expect(entry: Callable[[], None], case: Path, words: set[str] | None = None) -> bool:
    """Run ``entry``: True if it succeeded, False if it refused in one line naming ``case``
    (or one of ``words``: the keys a recipe changed); :class:`Crash` on any other outcome."""
    from storage.nvme import NvmeError

    try:
        with _deadline(CASE_SECONDS):
            entry()
    except _Hang:
        raise Crash(("hang", "?"), f"ran past {CASE_SECONDS} s") from None
    except (ValueError, OSError, NvmeError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        named = any(  # a key as written, or as repr() shows one with unprintable characters
            (w in first or repr(w)[1:-1] in first) if w else '""' in first for w in words or ()
        )
        if MARK not in first and not named:
            where = _where(exc)
            raise Crash(
                (f"unclear {type(exc).__name__}", where), f"first line {first[:300]!r}"
            ) from exc
        return False
    except Crash:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise Crash((type(exc).__name__, _where(exc)), repr(exc)[:300]) from exc
    return True


def _unchanged(case: Path, before: dict[str, str]) -> None:
    after = tree_digest(case)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        raise Crash(("input changed", "?"), f"files changed: {changed[:5]}")


# -- surfaces ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Surface:
    """One input surface: its seed, the files of the seed a mutation may touch, how each is
    mutated, and the entry points run on the mutated copy."""

    name: str
    seed: Callable[[Path], Path]
    files: Callable[[Path], list[list[Path]]]
    mutate: Callable[[st.DataObject, Path], None]
    run: Callable[[Path, Path], None]


def _glob(*patterns: str) -> Callable[[Path], list[list[Path]]]:
    """The files of each pattern (a mutation draws a pattern, then one of its files: the one
    meta.json weighs as much as the forty arrays' zarr.json)."""

    def files(root: Path) -> list[list[Path]]:
        groups = [sorted(p for p in root.glob(pat) if p.is_file()) for pat in patterns]
        return [g for g in groups if g]

    return files


def _json_or_bytes(data: st.DataObject, path: Path) -> None:
    if data.draw(st.integers(0, 3), label="json?") and path.suffix == ".json":
        mut.mutate_json_file(data, path)
    else:
        mut.mutate_bytes_file(data, path)


SURFACES: dict[str, Surface] = {
    "config.json": Surface(
        "config.json", seed_model_dir, _glob("config.json"), _json_or_bytes, model_dir_entries
    ),
    "safetensors": Surface(
        "safetensors",
        seed_model_dir,
        _glob("*.safetensors"),
        mut.mutate_safetensors_file,
        model_dir_entries,
    ),
    "store": Surface(
        "store",
        seed_store,
        _glob("zarr.json", "*/zarr.json", "*/c/**/*", "*/c", "*.json"),
        _json_or_bytes,
        store_entries,
    ),
    "checkpoint": Surface(
        "checkpoint",
        seed_checkpoint,
        _glob(
            "meta.json",
            "state.zarr/zarr.json",
            "state.zarr/*/zarr.json",
            "state.zarr/*/*/zarr.json",
            "state.zarr/*/*/c/**/*",
            "state.zarr/*/*/c",
        ),
        _json_or_bytes,
        checkpoint_entries,
    ),
    "trainer-state": Surface(
        "trainer-state",
        seed_checkpoint,
        _glob("trainer_state.*"),
        lambda data, path: (
            mut.mutate_safetensors_file(data, path)
            if path.suffix == ".safetensors"
            else _json_or_bytes(data, path)
        ),
        checkpoint_entries,
    ),
}
"""Surface name -> surface (more are added by :mod:`fuzz_text` for prompts and recipes)."""


def run_case(surface: Surface, data: st.DataObject, work: Path) -> None:
    """Copy ``surface``'s seed under ``work``, mutate one or two of its files, run its entry
    points; :class:`Crash` on a breach of the contract (see the module doc)."""
    seed = surface.seed(work / "seeds")
    case_root = work / "case"
    shutil.rmtree(case_root, ignore_errors=True)
    case_root.mkdir(parents=True)
    case = case_root / MARK
    shutil.copytree(seed, case)
    groups = surface.files(case)
    for _ in range(data.draw(st.integers(1, 2), label="files")):
        group = data.draw(st.sampled_from(groups), label="kind of file")
        target = data.draw(st.sampled_from(group), label="file")
        surface.mutate(data, target)
    scratch = case_root / "scratch"
    scratch.mkdir()
    # the store surface resumes convert from the seed model: reachable as seeds/model
    (case_root / "seeds").symlink_to(work / "seeds")
    os.environ.setdefault("BB_CACHE_DIR", str(work / "cache"))
    surface.run(case, scratch)
