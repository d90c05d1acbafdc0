"""Checks of what a balance_beam run is given, before anything is built: the compute
dtype, the Trainer's gradient clipping, the hardware argument and the store settings.
Each refuses a value that cannot work in one line naming it and the fix."""

from __future__ import annotations

import difflib
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from bb_lightning.bounds import check_int
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.planner import HardwareProfile
from bb_lightning.planner.profile import preset_names
from storage.store import StoreConfig

__all__ = [
    "ComputeDtype",
    "check_clipping",
    "check_hardware",
    "check_settings",
    "clip_config",
    "compute_dtype",
    "compute_dtype_check",
]

ComputeDtype = Literal["bf16", "fp32"]
_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def clip_config(trainer: pl.Trainer | None) -> ClipConfig:
    """The Trainer's gradient clipping as the engine runs it, as plain Lightning reads it.

    ``gradient_clip_val`` None or 0 means no clipping; ``gradient_clip_algorithm``
    ``"norm"`` (the default) clips the global 2-norm, ``"value"`` clamps each gradient
    element to [-value, value]. A negative or non-finite value raises ``ValueError``.
    """
    value = None if trainer is None else trainer.gradient_clip_val
    algorithm = getattr(trainer, "gradient_clip_algorithm", None) or "norm"
    algorithm = str(getattr(algorithm, "value", algorithm)).lower()
    if value is not None and float(value) < 0:
        raise ValueError(
            f"gradient_clip_val={value} must be >= 0 (0 or None: no clipping): pass a "
            "positive maximum gradient norm or value"
        )
    return ClipConfig(value=float(value) if value else None, algorithm=algorithm)


def check_clipping(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Refuse, before training, clipping settings the engine cannot run; warn of a hook
    that would read or clip parameter gradients (there are none on the parameters)."""
    clip_config(trainer)
    if (
        type(module).configure_gradient_clipping
        is not pl.LightningModule.configure_gradient_clipping
    ):
        raise ValueError(
            f"{type(module).__name__} overrides configure_gradient_clipping, which balance_beam "
            "cannot run (gradients reach the host AdamW, never .grad): remove the override and "
            "set Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm' or 'value')"
        )
    if type(module).on_before_optimizer_step is not pl.LightningModule.on_before_optimizer_step:
        rank_zero_warn(
            f"{type(module).__name__} overrides on_before_optimizer_step: under balance_beam "
            "the parameters hold no .grad there (the gradients are summed in the store and "
            "stepped by the host AdamW), so gradient norms read or clipping done in that hook "
            "see nothing; clip with Trainer(gradient_clip_val=...)"
        )


def compute_dtype_check(given: str | None) -> None:
    """Refuse a compute dtype other than ``"bf16"``, ``"fp32"`` or None."""
    if given is not None and given not in _DTYPES:
        raise ValueError(f"compute_dtype={given!r}: use 'bf16' or 'fp32'")


def compute_dtype(given: str | None, precision: str) -> torch.dtype:
    """The compute dtype: ``given``, else the Trainer's ``precision`` flag's."""
    if given is not None:
        return _DTYPES[given]
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision in ("32-true", "32"):
        return torch.float32
    raise ValueError(
        f"precision={precision!r} is not supported by balance_beam: use 'bf16-true', "
        "'bf16-mixed' or '32-true'"
    )


def check_settings(
    dtype: str | None,
    gather_limit: int | None,
    store: StoreConfig | None,
    nvme_path: str | None,
    *,
    hardware: object = None,
) -> None:
    """Refuse constructor arguments that cannot work, before anything is built."""
    compute_dtype_check(dtype)
    check_int("gather_limit", gather_limit, low=0, what="bytes of weights given back",
              example=16 << 30, none="80% of the available host memory")  # fmt: skip
    check_hardware(hardware)
    if store is not None and nvme_path is not None and store.nvme_path != nvme_path:
        raise ValueError(
            f"nvme_path={nvme_path!r} and store.nvme_path={store.nvme_path!r} disagree: "
            "give the NVMe directory once, in StoreConfig(nvme_path=...) when passing store"
        )


def check_hardware(hardware: object) -> None:
    """Refuse a ``hardware`` that is neither None, ``"measure"``, a preset name nor a profile."""
    if hardware is None or isinstance(hardware, HardwareProfile):
        return
    names = preset_names()
    if isinstance(hardware, str) and hardware.strip().lower() in [*names, "measure"]:
        return
    near = difflib.get_close_matches(str(hardware).strip().lower(), [*names, "measure"], n=1)
    hint = f" (closest: {near[0]!r})" if near else ""
    raise ValueError(
        f"hardware={hardware!r}: must be 'measure' (this machine, measured and cached) or a "
        f"preset: {', '.join(names)}{hint}"
    )
