"""``pip install .`` without extras gives a package that imports and trains.

The core dependencies are ``[project] dependencies`` in ``pyproject.toml``; the
``gpu``, ``peft`` and ``dev`` extras add only what they name. The first test imports
every module of the packages with the extras' packages made unimportable; the slow
one installs the package without extras into a fresh virtual environment (torch from
the local wheel folder, as ``scripts/setup.sh`` does) and runs one fit step there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from bb_lightning.engine import native

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("accelerate", "peft", "kvikio", "pytest", "hypothesis")
"""Packages that only an extra installs: nothing in the core may import them."""

FIT_ONE_STEP = textwrap.dedent(
    """
    import sys

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM

    import bb_lightning
    from bb_lightning.module import CausalLMModule
    from bb_lightning.placement import Placement
    from storage.tiers import Tier

    cfg = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
        max_position_embeddings=32,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[1])
    module = CausalLMModule(sys.argv[1], learning_rate=1e-3)  # streamed: built on meta
    strategy = bb_lightning.BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="fp32"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader([{"input_ids": ids}], batch_size=None))
    with torch.no_grad():
        loss = float(module({"input_ids": ids}))
    assert trainer.global_step == 1 and loss == loss, loss
    strategy.close()
    print("package", bb_lightning.__file__)
    print(f"fit one step, loss {loss:.4f}")
    from bb_lightning.engine import native  # the decode attention kernel's C source ships

    print("native kernel built", native.SOURCE.is_file() and native.kernel() is not None)
    """
)


def _env() -> dict[str, str]:
    """The environment without this checkout on the import path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
def test_core_imports_no_extra() -> None:
    block = "; ".join(f"sys.modules[{name!r}] = None" for name in EXTRAS_ONLY)
    code = (
        f"import sys; {block}\n"
        "import importlib, pkgutil\n"
        "import bb_lightning, storage\n"
        "for pkg in (bb_lightning, storage):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('imported')\n"
    )
    env = {**_env(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
def test_pip_install_without_extras_fits(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy(ROOT / name, src / name)
    for package in ("bb_lightning", "storage"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    pip = [
        str(python),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-compile",
        *links,
        "-c",
        str(src / "constraints.txt"),
    ]
    subprocess.run([*pip, str(src)], env=_env(), check=True, timeout=900, cwd=tmp_path)
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        env=_env(), capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    installed = {line.split("==")[0].lower() for line in listed.stdout.splitlines()}
    assert "balance-beam" in installed and not installed & set(EXTRAS_ONLY)
    (tmp_path / "fit.py").write_text(FIT_ONE_STEP)
    run = subprocess.run(
        [str(python), str(tmp_path / "fit.py"), str(tmp_path / "model")],
        env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"package {env_dir}" in run.stdout and "fit one step" in run.stdout
    if shutil.which(os.environ.get("CC", "cc")) and "avx512f" in native._cpu_signature().split():
        assert "native kernel built True" in run.stdout, run.stdout + run.stderr[-3000:]
