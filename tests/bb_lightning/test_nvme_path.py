"""``nvme_path`` as users give it: the run's scratch is rebuilt for a new run, a user's data
(a converted store, a checkpoint, any other directory) is refused and left byte for byte."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.cli import main
from bb_lightning.hf.convert import convert_checkpoint
from bb_lightning.placement import Placement
from bb_lightning.strategy.world import make_shared_nvme_dir
from storage.scratch import MARKER_NAME, read_marker
from storage.tiers import Tier

from .tiny import save_tiny, tiny_llama_config

N, H = Tier.NVME, Tier.HOST
PLACEMENT = Placement(weights=(N, N), master=(N, H), prefetch_depth=1)
STEPS = 2
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml"


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> SHA-256 of its bytes), and every folder."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def fit(
    tiny: SimpleNamespace, nvme: Path, precision: str, save: Path | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps of a 2-block Llama with blocks on NVMe: the losses and final weights."""
    module = tiny.make_module(tiny.tiny_llama(2))
    module.configure_model()
    strategy = BalanceBeamStrategy(placement=PLACEMENT, nvme_path=str(nvme))
    trainer, recorder = tiny.make_trainer(strategy, STEPS, precision=precision)
    try:
        trainer.fit(module, tiny.loader(STEPS))
        if save is not None:
            trainer.save_checkpoint(save)
        state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    finally:
        strategy.close()
    return recorder.losses, state


def test_bf16_then_fp32_on_one_nvme_path_trains_as_a_fresh_run(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    nvme = tmp_path / "nvme"
    fit(tiny, nvme, "bf16-true")
    losses, state = fit(tiny, nvme, "32-true")  # the bf16 scratch is rebuilt in fp32
    assert read_marker(nvme)["built_for"]["compute_dtype"] == "float32"  # type: ignore[index]
    fresh_losses, fresh_state = fit(tiny, tmp_path / "fresh", "32-true")
    assert losses == fresh_losses and len(losses) == STEPS
    assert state.keys() == fresh_state.keys()
    for key, value in fresh_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def user_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A converted store, a Hugging Face directory and a directory with a user's notes."""
    root = tmp_path_factory.mktemp("user")
    config = tiny_llama_config(
        2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=2048,
    )  # fmt: skip
    save_tiny(root / "hf", config)
    convert_checkpoint(root / "hf", root / "converted")
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("keep me")
    return {"converted": root / "converted", "hf": root / "hf", "notes": root / "notes"}


@pytest.mark.parametrize("kind", ["converted", "hf", "notes", "checkpoint"])
def test_a_users_directory_as_nvme_path_is_refused_and_unchanged(
    tiny: SimpleNamespace, tmp_path: Path, user_dirs: dict[str, Path], kind: str
) -> None:
    if kind == "checkpoint":
        target = tmp_path / "last.ckpt"
        fit(tiny, tmp_path / "nvme", "32-true", save=target)
        assert (target / "meta.json").is_file()
    else:
        target = user_dirs[kind]
    before = tree(target)
    with pytest.raises(ValueError) as err:
        fit(tiny, target, "32-true")
    message = str(err.value)
    assert "\n" not in message and repr(str(target)) in message
    assert message.endswith("choose an empty or new directory for nvme_path")
    assert tree(target) == before  # not one byte written, renamed or removed


def test_a_new_directory_is_created_and_a_file_is_refused(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    losses, _ = fit(tiny, tmp_path / "new", "32-true")
    assert len(losses) == STEPS and (tmp_path / "new" / MARKER_NAME).is_file()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"^nvme_path '.*/afile' is a file, not a directory"):
        fit(tiny, tmp_path / "afile", "32-true")
    with pytest.raises(ValueError, match=r"parent directory '.*/gone' does not exist either"):
        fit(tiny, tmp_path / "gone" / "nvme", "32-true")
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("kind", ["file", "converted"])
def test_the_cli_refuses_a_file_or_a_users_directory_in_one_line(
    tmp_path: Path,
    user_dirs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "afile" if kind == "file" else user_dirs["converted"]
    if kind == "file":
        target.write_text("x")
    before = tree(target) if target.is_dir() else target.read_text()
    argv = [
        "fit", "--config", str(RECIPE), f"--trainer.strategy.init_args.nvme_path={target}",
        "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--samples=[]",
        "--data.init_args.max_tokens=20000", "--data.init_args.cache_dir=null",
        "--trainer.strategy.init_args.hardware=a100-80gb",  # planned without probes
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(target) in err[0] and "nvme_path" in err[0], err
    assert (tree(target) if target.is_dir() else target.read_text()) == before


def test_ranks_share_a_marked_directory_and_refuse_a_users(
    tmp_path: Path, user_dirs: dict[str, Path]
) -> None:
    """Data parallel: ``nvme_path`` holds ``rank<r>`` directories (each rank's scratch)."""
    shared = tmp_path / "ranks"
    make_shared_nvme_dir(str(shared), 2)  # created and marked
    assert read_marker(shared)["built_for"]["world_size"] == 2  # type: ignore[index]
    (shared / "rank0").mkdir()
    make_shared_nvme_dir(str(shared), 2)  # again, beside a rank's directory
    before = tree(user_dirs["notes"])
    with pytest.raises(ValueError, match="choose an empty or new directory for nvme_path"):
        make_shared_nvme_dir(str(user_dirs["notes"]), 2)
    assert tree(user_dirs["notes"]) == before
