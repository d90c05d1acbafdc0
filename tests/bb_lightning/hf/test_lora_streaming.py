"""LoRA on a checkpoint streamed one parameter at a time: the base stays on the meta
device until the strategy reads it under peft's names, the adapters keep their seeded
initial values, and training equals plain Lightning on the model ``from_pretrained``
loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch
import torch
from peft import get_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

import bb_lightning.module as module_mod
from bb_lightning import BalanceBeamStrategy
from bb_lightning.hf.hf_load import HFCheckpoint, empty_model
from bb_lightning.hf.lora import LoraOptions, wrap_lora
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from ..tiny import VOCAB, save_tiny, saved, tiny_llama_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
LAYERS, STEPS = 3, 3
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a tied head, saved in shards with ``save_pretrained``."""
    config = tiny_llama_config(LAYERS, tie_word_embeddings=True)
    path = save_tiny(
        tmp_path_factory.mktemp("tiny-llama-tied"), config, seed=5, max_shard_size="100KB"
    )
    assert len(list(path.glob("*.safetensors"))) >= 2
    return path


def _llama() -> dict[str, Any]:
    return tiny_llama_config(LAYERS)


def _module(path: Path) -> CausalLMModule:
    return CausalLMModule(path, learning_rate=1e-2, weight_decay=0.01, lora=LORA, seed=7)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the whole model was loaded into host memory")


def test_streamed_lora_trains_like_plain_lightning(
    tiny: SimpleNamespace, ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain Lightning: configure_model loads the base with from_pretrained, then wraps it.
    ref = _module(ckpt)
    trainer, want = tiny.make_trainer("auto", STEPS)
    trainer.fit(ref, tiny.loader(STEPS))
    assert ref.model is not None
    want_state = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}

    reads: list[str] = []
    get = HFCheckpoint.get

    def counted(self: HFCheckpoint, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        reads.append(name)
        return get(self, name, dtype)

    monkeypatch.setattr(HFCheckpoint, "get", counted)
    monkeypatch.setattr(module_mod.AutoModelForCausalLM, "from_pretrained", _refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", _refuse)
    module = _module(ckpt)
    placement = Placement(weights=(N, D, H), master=(H, N, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32",
                                   nvme_path=str(tmp_path / "nvme"), adapt_tolerance=None)  # fmt: skip
    trainer, got = tiny.make_trainer(strategy, STEPS)
    trainer.fit(module, tiny.loader(STEPS))
    net = module.model
    assert net is not None

    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    got_adapters, want_adapters = (
        get_peft_model_state_dict(net),
        get_peft_model_state_dict(ref.model),
    )
    assert got_adapters.keys() == want_adapters.keys() and len(want_adapters) == 2 * LAYERS * 4
    for key, value in want_adapters.items():
        torch.testing.assert_close(got_adapters[key], value, rtol=1e-5, atol=2e-5, msg=key)
    # The base came from the checkpoint, each tensor read once, no adapter asked for.
    inner = net.get_base_model()
    base = [k for k, p in inner.named_parameters() if not p.requires_grad]
    assert sorted(reads) == sorted(base) and any(".base_layer." in k for k in base)
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # still tied
    state = net.state_dict()
    assert state.keys() == want_state.keys()
    for key, p in net.named_parameters():
        if not p.requires_grad:
            assert torch.equal(state[key], want_state[key]), key
    strategy.close()


def test_meta_base_gets_real_seeded_adapters(ckpt: Path) -> None:
    """Wrapped on the meta device, the adapters draw the values a materialised base gets;
    the checkpoint reader serves the base under peft's names and refuses the adapters."""
    options = LoraOptions.from_value(LORA)
    config = AutoConfig.from_pretrained(ckpt)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    torch.manual_seed(11)
    want = dict(wrap_lora(loaded, options).named_parameters())
    torch.manual_seed(11)
    wrapped = wrap_lora(empty_model(config), options)
    got = dict(wrapped.named_parameters())
    assert got.keys() == want.keys()
    for key, p in got.items():
        assert p.requires_grad == want[key].requires_grad, key
        if p.requires_grad:
            assert "lora_" in key and torch.equal(p, want[key]), key
        else:
            assert p.is_meta, key

    reader = HFCheckpoint(ckpt, wrapped)  # the PeftModel itself: base_model.model. names
    for key, p in got.items():
        if not p.requires_grad:
            assert torch.equal(reader.get(key), want[key].detach()), key
    adapter = next(k for k in got if "lora_A" in k)
    assert reader.resolve(adapter) is None
    with pytest.raises(ValueError, match="is an adapter"):
        reader.get(adapter)


def test_meta_base_streams_the_copies_peft_trains_whole(ckpt: Path) -> None:
    """peft's ``modules_to_save`` trains a copy of a base layer: on a meta base the copy
    stays on the meta device, trainable, and is read from the checkpoint under the base
    layer's name, like the frozen original."""
    options = LoraOptions.from_value({**LORA, "modules_to_save": ["lm_head", "model.norm"]})
    wrapped = wrap_lora(empty_model(AutoConfig.from_pretrained(ckpt)), options)
    params = wrapped.state_dict(keep_vars=True)  # tied ones under each name
    copies = {k: p for k, p in params.items() if ".modules_to_save." in k}
    assert len(copies) == 2 and all(p.is_meta and p.requires_grad for p in copies.values())
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    reader = HFCheckpoint(ckpt, wrapped)
    for key in copies:
        original = key.replace(".modules_to_save.default.", ".original_module.")
        assert params[original].is_meta and not params[original].requires_grad
        base = key.replace(".modules_to_save.default.", ".").removeprefix("base_model.model.")
        assert torch.equal(reader.get(key), loaded[base]), key
        assert torch.equal(reader.get(original), loaded[base]), key


def test_streamed_lora_trains_saved_modules_like_plain_lightning(
    tiny: SimpleNamespace, ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``modules_to_save`` on a streamed base: the head (tied to the embedding on disk) and
    each block's MLP norm trained whole beside the adapters, with full fp32 state; losses,
    adapters and trained copies as plain Lightning with peft, and in the saved adapter."""
    lora = {**LORA, "modules_to_save": ["lm_head", "post_attention_layernorm"]}

    def make() -> CausalLMModule:
        return CausalLMModule(ckpt, learning_rate=1e-2, weight_decay=0.01, lora=lora, seed=7)

    ref = make()
    trainer, want = tiny.make_trainer("auto", STEPS)
    trainer.fit(ref, tiny.loader(STEPS))
    assert ref.model is not None
    ref.model.save_pretrained(tmp_path / "want")

    monkeypatch.setattr(module_mod.AutoModelForCausalLM, "from_pretrained", _refuse)
    module = make()
    placement = Placement(weights=(N, D, H), master=(H, N, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32",
                                   nvme_path=str(tmp_path / "nvme"), adapt_tolerance=None)  # fmt: skip
    trainer, got = tiny.make_trainer(strategy, STEPS)
    trainer.fit(module, tiny.loader(STEPS))
    net = module.model
    assert net is not None and strategy.store is not None
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    store = strategy.store
    fp32_state = sum(store.spec(n).nbytes for n in store.names()
                     if n.rsplit(".", 1)[-1] in ("master", "exp_avg", "exp_avg_sq", "grad")
                     and not n.startswith("engine.scratch"))  # fmt: skip
    assert fp32_state == 16 * trainable  # master + two moments + accumulator, 4 bytes each

    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    want_sd, got_sd = get_peft_model_state_dict(ref.model), get_peft_model_state_dict(net)
    saved = [k for k in want_sd if "lora_" not in k]
    assert got_sd.keys() == want_sd.keys() and len(saved) == 1 + LAYERS
    for key, value in want_sd.items():
        torch.testing.assert_close(got_sd[key], value, rtol=1e-5, atol=2e-5, msg=key)
    inner = net.get_base_model()
    head = inner.lm_head
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)
    assert not head.original_module.weight.requires_grad  # the original stays frozen

    net.save_pretrained(tmp_path / "got")
    want_file = safetensors.torch.load_file(tmp_path / "want" / "adapter_model.safetensors")
    got_file = safetensors.torch.load_file(tmp_path / "got" / "adapter_model.safetensors")
    assert got_file.keys() == want_file.keys() and any("lm_head" in k for k in got_file)
    for key, value in want_file.items():
        torch.testing.assert_close(got_file[key], value, rtol=1e-5, atol=2e-5, msg=key)
    strategy.close()


def test_lora_on_fused_experts_trains_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """peft's default targets on a Qwen3-MoE checkpoint reach its fused expert weights,
    which peft wraps in a parametrization registered (an in-place change of the expert
    weights) at every forward: the block's other streamed weights keep their own version
    counters, so autograd still takes them (it refused them as modified in place), and
    the adapters train as under plain Lightning."""
    from torch.utils.data import DataLoader

    path = saved("qwen3_moe", tmp_path / "ckpt")
    data = [{"input_ids": b["input_ids"] % VOCAB} for b in tiny.batches(2 * 2)]
    runs = []
    for strategy in (
        "auto",
        BalanceBeamStrategy(
            placement=Placement.uniform(2, weights=N, master=N, prefetch_depth=1),
            compute_dtype="fp32", nvme_path=str(tmp_path / "nvme"), adapt_tolerance=None,
        ),
    ):  # fmt: skip
        torch.manual_seed(0)
        module = CausalLMModule(path, learning_rate=1e-3, lora={"rank": 4})
        trainer, recorder = tiny.make_trainer(strategy, 2, accumulate_grad_batches=2)
        trainer.fit(module, DataLoader(data, batch_size=None))  # type: ignore[arg-type]
        assert module.model is not None
        runs.append((recorder.losses, get_peft_model_state_dict(module.model)))
        if isinstance(strategy, BalanceBeamStrategy):
            strategy.close()
    (want_losses, want), (losses, got) = runs
    assert any(".experts." in k for k in want)  # the fused experts carry adapters
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)
