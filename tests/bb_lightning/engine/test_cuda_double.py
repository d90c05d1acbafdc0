"""The training engine under the CPU double of CUDA's copy semantics (storage.deferred).

Copies between the device arena and host memory land only when the host synchronises
on them, as on CUDA, so a host step on a buffer that a copy has not filled yet reads
NaN, and a host buffer reused while a copy still reads it corrupts that copy.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from bb_lightning.engine.budgets import required_budgets
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

from ..tiny import LAYERS, cpu_engine, tiny_llama
from .test_generate import NEW, _model, _prompts, _reference


def _double_store(model: torch.nn.Module, placement: Placement) -> TieredStore:
    numels = [sum(p.numel() for p in b.parameters()) for b in model.model.layers]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    need = required_budgets(numels, rest, replace(placement, compute_dtype="float32"))
    return TieredStore(
        StoreConfig(
            device_budget=need[Tier.DEVICE],
            host_budget=need[Tier.HOST],
            device="cpu",
            cuda_double=True,
        )
    )


@pytest.mark.parametrize(
    ("master", "overlap"),
    [(Tier.DEVICE, False), (Tier.DEVICE, True), (Tier.HOST, True)],
)
def test_device_home_blocks_step_like_torch_adamw_under_the_double(
    master: Tier, overlap: bool
) -> None:
    """Every block's weights (and optimizer state) on DEVICE, as when the model fits the
    device: the host AdamW step reads state that a device-to-host copy brings, and the
    weights go back from a reused host buffer. Losses and final weights equal torch."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    placement = Placement(
        weights=(Tier.DEVICE,) * LAYERS,
        master=(master,) * LAYERS,
        grads=(Tier.HOST,) * LAYERS,
    )
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(
        reference.parameters(), lr=adamw.lr, betas=adamw.betas, weight_decay=adamw.weight_decay
    )
    gen = torch.Generator().manual_seed(5)
    with _double_store(model, placement) as store:
        engine = cpu_engine(model, store, placement)
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            if overlap:
                engine.begin_overlapped_step(adamw)
            loss = engine.model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.after_backward()
            want = reference(input_ids=ids, labels=ids).loss
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            engine.optimizer_step(adamw, ClipConfig())
            opt.step()
            opt.zero_grad()
        assert store._io.double is not None and store._io.double.poisoned_bytes > 0
        state = engine.state_dict()
        engine.close()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_device_home_inference_weights_load_and_generate_under_the_double() -> None:
    """load_state_dict casts every block into one host buffer and writes it to its
    DEVICE home; each write must complete before the next block refills the buffer.
    Greedy tokens then equal Hugging Face generate with those weights."""
    model, other = _model("llama"), _model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    store = TieredStore(
        StoreConfig(device_budget=16 << 20, host_budget=16 << 20, device="cpu", cuda_double=True)
    )
    _, blocks = find_block_list(model)
    engine = InferenceEngine(
        model,
        list(blocks),
        store,
        Placement.uniform(len(blocks), weights=Tier.DEVICE, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
    engine.load_state_dict(other.state_dict())
    ids, mask = _prompts()
    out = LayerMajorGenerator(model).generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == _reference(other)
    engine.close()
    store.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_host_home_blocks_page_by_copy_and_step_like_torch_adamw_under_the_double(
    overlap: bool,
) -> None:
    """Every block's weights and state on HOST: under the double, as on CUDA, each page-in
    is a copy into a device slot (so the blocks are recomputed in backward, not kept
    bound), and each stepped block's weights are cast into its home while it is released.
    Losses and final weights equal torch.optim.AdamW."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    placement = Placement.uniform(LAYERS, weights=Tier.HOST, master=Tier.HOST)
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(
        reference.parameters(), lr=adamw.lr, betas=adamw.betas, weight_decay=adamw.weight_decay
    )
    gen = torch.Generator().manual_seed(6)
    with _double_store(model, placement) as store:
        engine = cpu_engine(model, store, placement)
        assert engine.paged.autograd_blocks == frozenset()  # copied in: recomputed
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            if overlap:
                engine.begin_overlapped_step(adamw)
            loss = engine.model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.after_backward()
            want = reference(input_ids=ids, labels=ids).loss
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            engine.optimizer_step(adamw, ClipConfig())
            opt.step()
            opt.zero_grad()
        store._io.synchronize()  # every copy's timing is read back
        assert store.stats()["h2d"].count >= 3 * LAYERS  # each forward's page-ins
        state = engine.state_dict()
        engine.close()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
