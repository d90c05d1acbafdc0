"""``trainer.predict`` under balance_beam with the KV cache on the host and decode attention
run there (``Placement.decode_attention``, given or planned), against Hugging Face greedy
``generate`` (fp32) on a ``save_pretrained`` directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from bb_lightning import BalanceBeamStrategy
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner.plan import PlanOverrides
from storage.tiers import Tier

from .tiny import FAMILIES, VOCAB, check_like_generate, cpu_profile, save_tiny

NEW = 6
H, N = Tier.HOST, Tier.NVME

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(seed: int, lengths: tuple[int, ...]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : width - n], mask[row, : width - n] = 0, 0
    return {"id": [f"{seed}-{r}" for r in range(len(lengths))], "input_ids": ids,
            "attention_mask": mask}  # fmt: skip


def _check(path: Path, module: CausalLMModule, batches: list[Any], records: Any) -> None:
    check_like_generate(path, module, batches, records, NEW)


@pytest.mark.parametrize("family", ["mistral_sliding", "lfm2_conv"])
def test_a_host_attention_placement_predicts_like_hf_generate(
    family: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Weights on NVMe, the cache on the host with attention there; two batches on one cache
    (the sliding window of 8 passed by both)."""
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES[family], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    placement = dataclasses.replace(Placement.uniform(2, weights=N), kv_cache=H, decode_attention=H)
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    batches = [_prompts(5, (7, 3, 5)), _prompts(6, (4, 7, 6))]
    records = trainer.predict(module, DataLoader(batches, batch_size=None))
    gen = module._generator
    assert gen is not None and (gen.kv_tier, gen.attention_tier) == (H, H)
    assert gen._kv is not None and gen._kv.host_attention
    strategy.close()
    _check(path, module, batches, records)


def test_a_plan_with_host_attention_runs_it(tiny: SimpleNamespace, tmp_path: Path) -> None:
    """``PlanOverrides.decode_attention=HOST``: the planned placement reaches the generator."""
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES["llama"], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        hardware=cpu_profile(), compute_dtype="fp32",
        overrides=PlanOverrides(decode_attention=H),
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    batches = [_prompts(7, (6, 2, 5))]
    records = trainer.predict(module, DataLoader(batches, batch_size=None))
    assert strategy.plan is not None and strategy.plan.placement.decode_attention is H
    gen = module._generator
    assert gen is not None and gen.attention_tier is H and gen.kv_tier is H
    strategy.close()
    _check(path, module, batches, records)


def test_a_placement_spilling_the_kv_cache_to_nvme_predicts_like_hf_generate(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The last block's KV cache homed on NVMe (files under the store's NVMe path), the
    first's in host memory; ragged prompts, two batches on one cache."""
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES["qwen2_tied"], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    placement = dataclasses.replace(
        Placement.uniform(2, weights=N), kv_cache=H, decode_attention=H, kv_cache_nvme_blocks=1
    )
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    batches = [_prompts(8, (7, 3, 5)), _prompts(9, (4, 7, 6))]
    records = trainer.predict(module, DataLoader(batches, batch_size=None))
    gen = module._generator
    assert gen is not None and gen._kv is not None and gen._kv.nvme_layers == 1
    files = [p for p in (tmp_path / "nvme" / "kv-cache").rglob("*") if p.is_file()]
    assert len(files) == 2 and all(p.stat().st_size > 0 for p in files)  # keys, values
    strategy.close()
    _check(path, module, batches, records)


def test_the_placement_carries_the_blocks_of_kv_cache_on_nvme() -> None:
    base = {"weights": (H,) * 2, "master": ()}
    p = Placement(**base, kv_cache=H, decode_attention=H, kv_cache_nvme_blocks=1)
    assert Placement.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match=r"kv_cache_nvme_blocks=1: .*decode_attention=Tier.HOST"):
        Placement(**base, kv_cache=H, kv_cache_nvme_blocks=1)


@pytest.mark.parametrize("tier", [Tier.DEVICE, H])
def test_two_threads_attend_on_torch_s_team_and_predict_like_hf_generate(
    tier: Tier, tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At two intra-op threads a CPU decode step attends through the compiled kernel on torch's
    own OpenMP team (where the kernel built with OpenMP), the KV cache on the device or on
    the host; the tokens are ``generate``'s."""
    from bb_lightning.engine import native

    kern = native.kernel()
    if kern is None or not kern.team:
        pytest.skip("the compiled kernel with OpenMP does not build here")
    calls: list[int] = []
    team = native.NativeAttention.attend_team
    monkeypatch.setattr(native.NativeAttention, "attend_team",
                        lambda self, *a: calls.append(1) or team(self, *a))  # fmt: skip
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES["qwen2_tied"], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    placement = dataclasses.replace(Placement.uniform(2, weights=H), kv_cache=tier,
                                    decode_attention=tier)  # fmt: skip
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    batches = [_prompts(8, (6, 2, 5, 7))]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        records = trainer.predict(module, DataLoader(batches, batch_size=None))
    finally:
        torch.set_num_threads(threads)
    strategy.close()
    assert len(calls) >= NEW - 1  # every decode step of each attention layer
    _check(path, module, batches, records)
