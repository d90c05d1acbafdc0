"""The plan ``bb-lightning predict --config RECIPE --dry-run`` dry-runs: the recipe's
generation job planned on the preset its strategy names, as a run plans it.

A run plans :class:`~bb_lightning.planner.PredictJob` from its prompts (the longest, and
how many) and runs batches of the datamodule's ``batch_size`` prompts
(:meth:`bb_lightning.strategy.session.PlanningSession.plan_predict`). A dry run reads no prompt:
it prices the longest prompt the datamodule accepts (``max_prompt_len``), counts the
prompts file's lines when the file is there (else one batch), and forces the recipe's
``batch_size`` as the run does.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bb_lightning.cli.errors import UsageError
from bb_lightning.cli.plan_args import runs_sdpa
from bb_lightning.planner import Plan
from storage.tiers import Tier

if TYPE_CHECKING:
    import torch

    from bb_lightning.hf.lora import LoraOptions
    from bb_lightning.planner.profile import ModelProfile

__all__ = ["fit_recipe_profile", "predict_recipe_plan", "recipe_model_spec"]


def recipe_model_spec(cfg: Any) -> Any:
    """The recipe's ``model.init_args.model``: a path, hub id or built-in name, or the
    config mapping (jsonargparse leaves a mapping as its text)."""
    spec = cfg.model.init_args.model
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            return ast.literal_eval(spec)
        except (ValueError, SyntaxError) as err:
            raise UsageError(f"model.init_args.model={spec!r} is not a mapping: {err}") from err
    return spec


def _prompts(path: Any, batch: int | None) -> tuple[int, str]:
    """Prompts in the job and where the count comes from: the prompts file's non-empty
    lines when it exists, else one batch (4096 prompts when the batch is the plan's)."""
    file = Path(str(path)) if path else None
    if file is not None and file.is_file():
        with file.open(encoding="utf-8", errors="replace") as lines:
            count = sum(1 for line in lines if line.strip())
        return max(1, count), f"the {count} lines of {file}"
    if batch is not None:
        return batch, f"one batch ({file} is absent)"
    return 4096, f"4096 ({file} is absent and the batch is the plan's)"


def predict_recipe_plan(cfg: Any, hardware: str) -> tuple[Plan, Any, str]:
    """Plan a predict recipe's job (parsed ``cfg``) on preset ``hardware``: the plan, the
    model's config and a line saying what was priced. A batch the planner cannot run is
    a :class:`UsageError` naming it."""
    from bb_lightning.module import resolve_model_config
    from bb_lightning.planner import PlanOverrides, PredictJob, make_plan, preset
    from bb_lightning.planner.search import PlanError
    from bb_lightning.probe import model_profile_from_config
    from bb_lightning.strategy.session import compute_dtype

    strategy = getattr(cfg.trainer.strategy, "init_args", None)
    module, data = cfg.model.init_args, cfg.data.init_args
    new = getattr(module, "max_new_tokens", None)
    plen = getattr(data, "max_prompt_len", None)
    if not isinstance(new, int) or not isinstance(plen, int):
        raise UsageError(
            f"--dry-run of a predict recipe needs model.init_args.max_new_tokens and "
            f"data.init_args.max_prompt_len as integers (got {new!r} and {plen!r}): set both"
        )
    batch = getattr(data, "batch_size", None)
    count, counted = _prompts(getattr(data, "path", None), batch)
    dtype = compute_dtype(getattr(strategy, "compute_dtype", None), str(cfg.trainer.precision))
    job = PredictJob(prompt_len=plen, new_tokens=new, num_prompts=count,
                     compute_dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    config, _ = resolve_model_config(recipe_model_spec(cfg))
    profile = model_profile_from_config(config)
    forced = None if batch is None else PlanOverrides(concurrent_seqs=min(batch, count))
    if not runs_sdpa(config):  # as a run plans it: host attention serves 'sdpa' only
        forced = dataclasses.replace(forced or PlanOverrides(), decode_attention=Tier.DEVICE)
    try:
        plan = make_plan(profile, preset(hardware), job, overrides=forced)
    except PlanError as err:
        raise UsageError(
            f"--dry-run: {hardware} cannot run batches of {batch} prompts of {plen} + {new} "
            f"tokens ({err}): lower data.init_args.batch_size, or set it to null for the "
            "plan's"
        ) from err
    said = (f"dry run of the recipe's job: prompts of up to {plen} tokens, {new} new tokens, "
            f"{count} prompts ({counted}), batches of {plan.concurrent_seqs}")  # fmt: skip
    return plan, config, said


def fit_recipe_profile(
    cfg: Any, config: Any, dtype: torch.dtype
) -> tuple[ModelProfile, LoraOptions | None]:
    """The profile a fit recipe's (parsed ``cfg``) run plans the model of ``config`` on,
    and its LoRA options: with ``model.init_args.lora`` the adapters train over the frozen
    base, profiled on the wrapped model on ``meta`` as a run profiles it; bad options or a
    missing ``peft`` are a :class:`UsageError`."""
    from bb_lightning.hf.lora import LoraOptions, require_peft
    from bb_lightning.probe import model_profile_from_config, model_profile_from_module

    value = getattr(cfg.model.init_args, "lora", None)
    if value is None:
        return model_profile_from_config(config), None
    try:
        lora = LoraOptions.from_value(dict(value))
        require_peft()
    except (ValueError, ImportError) as err:
        raise UsageError(f"--dry-run of model.init_args.lora: {err}") from err
    from bb_lightning.strategy.dryrun import meta_model

    return model_profile_from_module(meta_model(config, dtype, lora=lora)), lora
