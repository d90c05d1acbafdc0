"""The strategy's settings in groups (``planning=``, ``hand_back=``) mean what the flat
keyword arguments of the same names mean; a setting given both ways is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from bb_lightning import BalanceBeamStrategy
from bb_lightning.cli import main
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import PlanOverrides
from bb_lightning.strategy.settings import HandBackConfig, PlanningConfig
from storage.tiers import Tier

from ..tiny import hf_config

H, N = Tier.HOST, Tier.NVME
STEPS = 3


def test_grouped_settings_train_as_plain_lightning_and_hand_back_as_asked(
    tiny: SimpleNamespace, tmp_path: Path, reference_run: Any
) -> None:
    placement = Placement(weights=(N, H, H, N), master=(H, N, H, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        nvme_path=str(tmp_path / "nvme"),
        planning=PlanningConfig(
            placement=placement, compute_dtype="fp32", warmup_steps=2, adapt_tolerance=None,
            overlap_optimizer=False,
        ),
        hand_back=HandBackConfig(gather_on_teardown=True),
    )  # fmt: skip
    assert (strategy.compute_dtype, strategy.warmup_steps, strategy.adapt_tolerance) == (
        "fp32", 2, None,
    )  # fmt: skip
    assert (strategy.placement, strategy.overlap_optimizer) == (placement, False)
    module = tiny.make_module(tiny.tiny_llama())
    trainer, recorder = tiny.make_trainer(strategy, STEPS)
    trainer.fit(module, tiny.loader(STEPS))
    assert strategy.store is None  # gather_on_teardown=True: handed back and closed
    losses, state = reference_run(tiny.tiny_llama(), STEPS)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    got = module.state_dict()
    assert got.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_flat_argument_left_at_its_default_defers_to_the_group() -> None:
    # LightningCLI passes every flat argument, at its default when the recipe omits it
    strategy = BalanceBeamStrategy(
        compute_dtype=None, hardware=None, warmup_steps=3, adapt_tolerance=0.25,
        overlap_optimizer=True, gather_on_teardown=None, gather_limit=None,
        planning=PlanningConfig(
            compute_dtype="bf16", hardware="h100", warmup_steps=5, adapt_tolerance=None,
            overlap_optimizer=False,
        ),
        hand_back=HandBackConfig(gather_on_teardown=False, gather_limit=1 << 30),
    )  # fmt: skip
    assert (strategy.compute_dtype, strategy.hardware) == ("bf16", "h100")
    assert (strategy.warmup_steps, strategy.adapt_tolerance) == (5, None)
    assert strategy.overlap_optimizer is False
    assert (strategy.gather_on_teardown, strategy.gather_limit) == (False, 1 << 30)


@pytest.mark.parametrize(
    ("flat", "grouped"),
    [
        ({"compute_dtype": "fp32"}, {"planning": PlanningConfig(compute_dtype="bf16")}),
        ({"compute_dtype": "fp32"}, {"planning": PlanningConfig(compute_dtype="fp32")}),
        ({"hardware": "h100"}, {"planning": PlanningConfig(hardware="a100-80gb")}),
        ({"warmup_steps": 4}, {"planning": PlanningConfig(warmup_steps=5)}),
        ({"adapt_tolerance": None}, {"planning": PlanningConfig(adapt_tolerance=0.5)}),
        ({"overlap_optimizer": False}, {"planning": PlanningConfig(overlap_optimizer=False)}),
        (
            {"overrides": PlanOverrides(prefetch_depth=2)},
            {"planning": PlanningConfig(overrides=PlanOverrides(prefetch_depth=3))},
        ),
        ({"gather_limit": 1 << 20}, {"hand_back": HandBackConfig(gather_limit=1 << 30)}),
        ({"gather_on_teardown": True}, {"hand_back": HandBackConfig(gather_on_teardown=False)}),
    ],
)
def test_a_setting_given_flat_and_grouped_is_refused_naming_both(
    flat: dict[str, Any], grouped: dict[str, Any]
) -> None:
    (key,) = flat
    (group,) = grouped
    match = rf"^{key} given twice, {key}=.* and {group}\.{key}=.*give it once, as {key}="
    with pytest.raises(ValueError, match=match) as err:
        BalanceBeamStrategy(**flat, **grouped)
    assert "\n" not in str(err.value)


def test_a_bad_value_in_a_group_is_refused_as_the_flat_one_is() -> None:
    with pytest.raises(ValueError, match=r"compute_dtype='fp16'.*'bf16' or 'fp32'"):
        BalanceBeamStrategy(planning=PlanningConfig(compute_dtype="fp16"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"warmup_steps=0 must be >= 1"):
        BalanceBeamStrategy(planning=PlanningConfig(warmup_steps=0))
    with pytest.raises(ValueError, match=r"gather_limit"):
        BalanceBeamStrategy(hand_back=HandBackConfig(gather_limit=-1))


def _cli_strategy(tmp_path: Path, strategy_args: str) -> BalanceBeamStrategy:
    yaml = textwrap.dedent(
        """
        trainer:
          accelerator: cpu
          devices: 1
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          strategy:
            class_path: bb_lightning.BalanceBeamStrategy
            init_args:
        """
    ) + textwrap.indent(textwrap.dedent(strategy_args), " " * 6)
    yaml += f"model:\n  model: {tmp_path / 'model'}\n"
    (tmp_path / "config.yaml").write_text(yaml)
    cli = LightningCLI(
        CausalLMModule, run=False, args=["--config", str(tmp_path / "config.yaml")],
        save_config_callback=None,
    )  # fmt: skip
    strategy = cli.trainer.strategy
    assert isinstance(strategy, BalanceBeamStrategy)
    return strategy


def test_lightning_cli_reads_the_planning_group_as_the_flat_keys(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    hf_config(tiny.tiny_llama(2)).save_pretrained(tmp_path / "model")
    flat = _cli_strategy(
        tmp_path,
        """
        compute_dtype: fp32
        hardware: a100-80gb
        warmup_steps: 2
        gather_limit: 1048576
        overrides:
          weights_tier: NVME
          prefetch_depth: 2
        """,
    )
    grouped = _cli_strategy(
        tmp_path,
        """
        planning:
          compute_dtype: fp32
          hardware: a100-80gb
          warmup_steps: 2
          overrides:
            weights_tier: NVME
            prefetch_depth: 2
        hand_back:
          gather_limit: 1048576
        """,
    )
    want = PlanOverrides(weights_tier=N, prefetch_depth=2)
    for strategy in (flat, grouped):
        assert (strategy.compute_dtype, strategy.hardware) == ("fp32", "a100-80gb")
        assert (strategy.warmup_steps, strategy.gather_limit) == (2, 1 << 20)
        assert strategy.overrides == want


def test_a_recipe_giving_a_setting_flat_and_grouped_is_one_line_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = Path(__file__).parents[3] / "recipes" / "tiny-cpu.yaml"
    code = main([
        "fit", "--config", str(recipe), f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.strategy.init_args.nvme_path={tmp_path / 'nvme'}",
        "--trainer.strategy.init_args.hardware=a100-80gb",
        "--trainer.strategy.init_args.planning.hardware=h100",
    ])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "hardware given twice, hardware='a100-80gb' and planning.hardware='h100'" in err
    assert not (tmp_path / "nvme").exists()
