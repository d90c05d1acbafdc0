"""``trainer.predict`` under balance_beam on a CPU device runs the Llama family's RMS norms
and rotary embeddings through the compiled kernels (``engine.host_norm``,
``engine.host_rope``) and predicts Hugging Face greedy ``generate``'s tokens (fp32) from a
``save_pretrained`` directory; other norms keep their class ``forward``, and the module's
norms and its model file's rotary function come back when the engine hands it back. In
bf16 its gated MLPs run ``engine.host_mlp`` and, where the CPU has matrix tiles or AVX-512's
bf16 products, its linear layers ``engine.host_linear``, and it predicts the tokens torch's
operations do."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_linear, host_mlp, native
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from .tiny import FAMILIES, VOCAB, check_like_generate, save_tiny

NEW = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("family", "served", "rotated"),
    [("llama", True, True), ("gemma_tied", False, True), ("phi3", True, False)],
)  # Gemma scales by 1 + weight; Phi-3's rotary function rotates a part of each head
def test_predict_norms_through_the_kernel_and_generates_like_hf(
    family: str, served: bool, rotated: bool, tiny: SimpleNamespace, tmp_path: Path,
    host_kernel: object, count_host_kernel: Callable[[str], list[int]],
) -> None:  # fmt: skip
    # the kernel loaded first: its load-time checks of the rotary embedding are not counted
    calls, ropes = count_host_kernel("__call__"), count_host_kernel("rope")
    kind = type(AutoModelForCausalLM.from_config(AutoConfig.for_model(**FAMILIES[family])))
    plain = sys.modules[kind.__module__].apply_rotary_pos_emb
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES[family], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2] = mask[0, :2] = 0  # a shorter prompt, padded on the left
    batch = {"id": ["a", "b", "c"], "input_ids": ids, "attention_mask": mask}
    records = trainer.predict(module, DataLoader([batch], batch_size=None))
    assert records is not None
    first, first_ropes = len(calls), len(ropes)
    # every block's two norms and the final one, at the prefill and each decode step; each
    # block's queries and keys
    steps = max(len(r["token_ids"]) for r in records[0])  # type: ignore[union-attr]
    assert (steps >= 1 and first >= 5 * steps) if served else not calls
    assert first_ropes >= 4 * steps if rotated else not ropes
    # the module handed back runs its own norms and rotary function; paged again, the kernels
    assert [type(m).__name__ for m in module.modules() if "forward" in vars(m)] == []
    assert sys.modules[kind.__module__].apply_rotary_pos_emb is plain
    again = trainer.predict(module, DataLoader([batch], batch_size=None))
    assert again == records and len(calls) == 2 * first and len(ropes) == 2 * first_ropes
    strategy.close()
    assert [type(m).__name__ for m in module.modules() if "forward" in vars(m)] == []
    assert sys.modules[kind.__module__].apply_rotary_pos_emb is plain
    check_like_generate(path, module, [batch], records, NEW)


@pytest.mark.parametrize(
    ("family", "head_dim", "kv_groups"), [("llama", 32, 4), ("qwen2_tied", None, None)]
)
def test_predict_bf16_runs_its_mlps_and_products_through_the_kernels(
    family: str, head_dim: int | None, kv_groups: int | None, tiny: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, host_kernel: object,
    count_host_kernel: Callable[..., list[int]],
) -> None:  # fmt: skip
    """In bf16 the model's gated MLPs run the one-pass SiLU and product
    (``engine.host_mlp``), and where the CPU has matrix tiles or AVX-512's bf16 products
    (``engine.host_linear``) its linear layers of few rows the compiled product, with heads of 32 the prefill's attention the
    compiled attention (on the tiles, or on AVX-512's bf16 products without them), and with four query heads a key/value head the decode
    steps' attention the tiles too: the greedy tokens equal a run with torch's operations
    (and the decode attention's vector products), and the module handed back runs its own
    ``forward``."""
    products = host_linear.kernel() is not None  # on the tiles or the vectors
    attend = host_linear.attention_kernel() is not None  # on the tiles or the vectors
    calls = count_host_kernel("__call__", host_linear._Kernel)
    prefills = count_host_kernel("prefill_attention", host_linear._Kernel)
    mlps = count_host_kernel("silu_mul")
    config = {**FAMILIES[family], "initializer_range": 0.2}
    if head_dim is not None:
        config["head_dim"] = head_dim
    if kv_groups is not None:
        config["num_attention_heads"] = kv_groups * config["num_key_value_heads"]
    decode = native.kernel()
    if kv_groups is not None and decode is not None and decode.set_tiles(True):
        # the decode steps' heads (7 prompt positions and up) run on the tiles
        assert decode.on_tiles(kv_groups, 8, 32, 32, torch.bfloat16)
    path = save_tiny(tmp_path / "ckpt", config)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3] = mask[1, :3] = 0
    batch = {"id": ["a", "b", "c"], "input_ids": ids, "attention_mask": mask}

    def run(name: str) -> object:
        strategy = BalanceBeamStrategy(
            placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="bf16",
            nvme_path=str(tmp_path / name),
        )  # fmt: skip
        return tiny.predict(path, batch, strategy, NEW)

    kernels = run("kernels")
    steps = max(len(r["token_ids"]) for r in kernels[0])  # type: ignore[index]
    # each block's MLP at the prefill and each step; with the compiled product, at least o,
    # gate, up and down of each block (16 k and v columns, Qwen2's biased q, k, v run the class's)
    assert steps >= 1 and len(mlps) >= 2 * steps
    assert len(calls) >= 2 * 4 * steps if products else not calls
    # each block's attention at the prefill (heads of 8 run sdpa)
    assert len(prefills) >= 2 if attend and head_dim == 32 else not prefills
    monkeypatch.setattr(host_linear, "kernel", lambda: None)
    monkeypatch.setattr(host_linear, "attention_kernel", lambda: None)
    monkeypatch.setattr(host_mlp, "install", lambda model: lambda: None)
    before = len(calls), len(mlps), len(prefills)
    if decode is not None:
        decode.set_tiles(False)
    try:
        assert run("torch") == kernels and (len(calls), len(mlps), len(prefills)) == before
    finally:
        if decode is not None:
            decode.set_tiles(True)
