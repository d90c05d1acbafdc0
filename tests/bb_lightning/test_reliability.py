"""What the library writes and reads survives damage and full disks, and never runs code.

``bb-lightning verify`` on stores and checkpoints; a full disk mid-checkpoint (injected
ENOSPC, and a real small tmpfs where this machine lets us mount one); an I/O error mid-step;
a checkpoint whose pickle would run code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zarr

from bb_lightning import BalanceBeamStrategy
from bb_lightning.cli import main
from bb_lightning.engine.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    load_checkpoint,
    read_array,
    read_meta,
    read_trainer_state,
    verify_checkpoint,
)
from bb_lightning.hf.convert import convert_checkpoint
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.fault_injection import Fault, inject
from storage.nvme import NvmeIOError
from storage.tiers import Tier

from .tiny import save_tiny, tiny_llama_config

N, H = Tier.NVME, Tier.HOST
PLACEMENT = Placement(weights=(N, N, N, N), master=(H, N, H, N), prefetch_depth=1)


def _flip(path: Path, at: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def hf_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config(
        2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=2048,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("store")
    save_tiny(root / "hf", cfg)
    convert_checkpoint(str(root / "hf"), root / "z", progress=False)
    return root / "z"


def test_verify_store_reports_each_damaged_chunk(
    hf_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "z"
    subprocess.run(["cp", "-r", str(hf_store), str(store)], check=True)
    names = sorted(zarr.open_group(store, mode="r").array_keys())
    assert main(["verify", str(store)]) == 0
    assert f"store {store}: ok: {len(names)} arrays" in capsys.readouterr().out
    _flip(store / names[0] / "c" / "0" / "0")
    os.truncate(store / names[1] / "c" / "0" / "0", 8)
    assert main(["verify", str(store)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert names[0] in lines[0] and "CRC-32C" in lines[0] and str(store / names[0]) in lines[0]
    assert names[1] in lines[1] and "holds 8 bytes" in lines[1]
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    capsys.readouterr()

    # a store of format 1 (plain zarr's default codecs, no checksum): lengths checked only
    old = zarr.open_group(tmp_path / "old", mode="w")
    old.create_array("w", shape=(10,), dtype="float32", chunks=(10,), compressors=None)[...] = 1.0
    assert main(["verify", str(tmp_path / "old")]) == 0
    assert "1 arrays, 0 B checksummed, 1 without checksum (format 1)" in capsys.readouterr().out


def _fit(
    tiny: SimpleNamespace, tmp: Path, steps: int, losses: list[float] | None = None
) -> tuple[Any, Any, list[float]]:
    strategy = BalanceBeamStrategy(
        placement=PLACEMENT, compute_dtype="fp32", nvme_path=str(tmp / "nvme")
    )
    trainer, recorder = tiny.make_trainer(strategy, steps)
    recorder.losses = losses if losses is not None else recorder.losses
    module = CausalLMModule(tiny.tiny_llama(4), learning_rate=1e-3, seed=0)
    trainer.fit(module, tiny.loader(steps))
    return trainer, strategy, recorder.losses


def _masters(path: Path) -> dict[str, torch.Tensor]:
    return {p["name"]: read_array(path, "master", p["name"]) for p in read_meta(path)["parameters"]}


def _mount_tmpfs(where: Path, size: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the injected-ENOSPC test covers this")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); injected ENOSPC covers it")


def _used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _remount(mount: Path, size: int) -> None:
    cmd = ["mount", "-o", f"remount,size={size}", str(mount)]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["injected", "tmpfs"])
def test_full_disk_mid_checkpoint_keeps_the_previous_one_and_the_store(
    tiny: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str], disk: str
) -> None:
    trainer, strategy, _ = _fit(tiny, tmp_path, 2)
    try:
        want = dict(strategy.lightning_module_state_dict())
        target = tmp_path / "ckpt"
        if disk == "tmpfs":
            _mount_tmpfs(tmp_path / "disk", 64 << 20)
            target = tmp_path / "disk" / "ckpt"
        try:
            trainer.save_checkpoint(target)
            if disk == "tmpfs":  # shrink the disk to 1.5 checkpoints
                _remount(tmp_path / "disk", _used(tmp_path / "disk") * 3 // 2)
            before = _masters(target)
            fault = Fault("write", errno.ENOSPC, path_contains="exp_avg_sq", after=5)
            with inject(fault) if disk == "injected" else contextlib.nullcontext():
                with pytest.raises(CheckpointWriteError, match="No space left") as err:
                    trainer.save_checkpoint(target)  # a second copy does not fit beside the first
            assert err.value.errno == errno.ENOSPC
            assert str(target) in str(err.value) and "previous checkpoint" in str(err.value)
            assert sorted(p.name for p in target.parent.iterdir() if "ckpt" in p.name) == ["ckpt"]
            assert not verify_checkpoint(target).problems
            after = _masters(target)
            assert all(torch.equal(after[k], v) for k, v in before.items())
            # the store is untouched: the live weights still read, a save elsewhere works
            got = dict(strategy.lightning_module_state_dict())
            assert all(torch.equal(got[k], v) for k, v in want.items())
            trainer.save_checkpoint(tmp_path / "again")
            assert main(["verify", str(tmp_path / "again")]) == 0
            assert "ok:" in capsys.readouterr().out
        finally:
            if disk == "tmpfs":
                subprocess.run(["umount", str(tmp_path / "disk")], check=False)
    finally:
        strategy.close()


@pytest.mark.slow
def test_eio_mid_step_fails_the_step_naming_tensor_and_file(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    # every block's weights live on NVMe (one flat tensor per block) and page in every step;
    # the second read of block 2 fails
    fault = Fault("read", errno.EIO, path_contains=".2.weight", after=1)
    losses: list[float] = []
    with (
        inject(fault),
        pytest.raises(NvmeIOError, match=r"tensor '.*\.2\.weight': cannot read .*I/O error") as err,
    ):
        _fit(tiny, tmp_path, 4, losses)
    assert len(losses) < 4 and all(math.isfinite(x) for x in losses)
    assert err.value.errno == errno.EIO and fault.failed
    assert fault.failed[0] in str(err.value)


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))  # unpickling it would create the marker file


@pytest.mark.slow
def test_checkpoint_whose_pickle_would_run_code_is_refused(
    tiny: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, strategy, _ = _fit(tiny, tmp_path, 1)
    try:
        path = tmp_path / "ckpt"
        trainer.save_checkpoint(path)
    finally:
        strategy.close()
    assert not (path / "trainer_state.pt").exists()  # nothing of Lightning's state needs pickle
    want = read_trainer_state(path)
    assert want["global_step"] == 1 and want["hyper_parameters"]["betas"] == (0.9, 0.95)

    # a version 1 checkpoint (its whole trainer state pickled) still loads, under the allowlist
    v1 = tmp_path / "v1"
    shutil.copytree(path, v1)
    meta = json.loads((v1 / "meta.json").read_text())
    (v1 / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    torch.save(want, v1 / "trainer_state.pt")
    (v1 / "trainer_state.json").unlink()
    got = read_trainer_state(v1)
    assert got.keys() == want.keys() and got["loops"] == want["loops"]

    marker = tmp_path / "marker"
    torch.save({"p0": _Marker(str(marker))}, path / "trainer_state.pt")
    doc = (path / "trainer_state.json").read_text()
    (path / "trainer_state.json").write_text(
        doc.replace('"epoch": 0', '"epoch": {"__bb__": "pickled", "key": "p0"}')
    )
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt: refused to load.*never runs"):
        load_checkpoint(path)
    assert main(["verify", str(path)]) == 1
    assert "refused to load" in capsys.readouterr().out
    assert not marker.exists()
