"""The GPU check's data-parallel step: one rank on one GPU through the sharded engine.

A process group of one rank (``cpu:gloo,cuda:nccl`` on CUDA, so the collectives on the
device run over NCCL; ``gloo`` in a dry run on the CPU) is still a process group: the
training engine built with a :class:`~bb_lightning.engine.shard.ShardComm` pages each
block's shard in, assembles the block on the device with an all-gather and
reduce-scatters its gradients there, exactly as at N ranks. Two optimizer steps of a tiny
fp32 Llama (weights on the host, optimizer state on the host) are compared with
``torch.optim.AdamW`` on the same batches on the CPU. Several GPUs are not run here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from bb_lightning.engine.budgets import required_budgets, shard_counts
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

ADAMW = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
STEPS, ROWS, SEQ, VOCAB = 2, 2, 32, 256


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(config).float()


def _store(model: LlamaForCausalLM, placement: Placement, device: torch.device) -> TieredStore:
    blocks = list(model.model.layers)
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    parts, rest_part = shard_counts(model, blocks, 1)
    need = required_budgets(numels, rest, placement, shard_numels=parts, shard_rest=rest_part)
    return TieredStore(StoreConfig(device_budget=need[Tier.DEVICE], host_budget=need[Tier.HOST],
                                   device=str(device)))  # fmt: skip


def one_rank(device: torch.device) -> dict[str, Any]:
    """Train :data:`STEPS` steps at world size 1 through the data-parallel path on
    ``device``; the figures (backend, bytes, largest difference from torch AdamW)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen) for _ in range(STEPS)]
    with tempfile.TemporaryDirectory(prefix="bb-dp-check-") as tmp:
        rendezvous = (Path(tmp) / "rendezvous").as_uri()
        dist.init_process_group(backend, init_method=rendezvous, rank=0, world_size=1)
        try:
            comm = ShardComm.from_world(backend=backend)
            model = _model()
            placement = Placement(weights=(Tier.HOST,) * 2, master=(Tier.HOST,) * 2,
                                  prefetch_depth=1, compute_dtype="float32")  # fmt: skip
            with _store(model, placement, device) as store:
                engine = TrainingEngine(model, model.model.layers, store, placement,
                                        device=device, comm=comm)  # fmt: skip
                for ids in batches:
                    ids = ids.to(device)
                    engine.begin_overlapped_step(ADAMW)
                    engine.model(input_ids=ids, labels=ids).loss.backward()
                    engine.after_backward()
                    engine.optimizer_step(ADAMW, ClipConfig())
                got = {k: s["master"].clone() for k, s in engine.iter_state(("master",))}
                links = {k.value: v.bytes for k, v in store.stats().items() if v.bytes}
                engine.close()
            figures: dict[str, Any] = {
                "backend": str(dist.get_backend(comm.group)), "world_size": comm.world_size,
                "collective_bytes": comm.bytes_sent, "link_bytes": links,
            }  # fmt: skip
        finally:
            dist.destroy_process_group()
    figures["max_abs_diff"] = max(
        float((got[k] - v).abs().max()) for k, v in _reference(batches).items()
    )
    return figures


def _reference(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch AdamW on the CPU, the same model and batches: the trained parameters."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas,
                            weight_decay=ADAMW.weight_decay)  # fmt: skip
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach().to(torch.float32) for k, p in model.named_parameters()}
