"""Time the model's own training pass on the device: a compute efficiency for the planner.

The hardware probe (:mod:`bb_lightning.planner.measure`) times bare square matrix
products. A training step of a real model also runs norms, activations, rotary
embeddings, attention and the loss, and its matrix products have the model's
(often smaller) shapes; on a CPU that step sustains well under the probe's rate.
:func:`probe_train_compute` measures it before the first step: it builds the
model's architecture from its config with one and with three blocks (random
weights, the compute dtype, on the device), times a forward + backward of one
micro-batch through each (alternating, median of a few passes each: a training
step is not the best of several runs), and takes half the difference as one block's time and the
rest as the embedding, final norm, head and loss. The full model's pass is then
``num_blocks * block + rest``, and its FLOPs
(:func:`~bb_lightning.planner.cost.train_flops_per_token`, no recompute) over
that time, divided by the probe's ``device_flops``, is the efficiency the
planner multiplies ``device_flops`` by.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from bb_lightning.planner import cost
from bb_lightning.planner.profile import HardwareProfile, ModelProfile

__all__ = ["TrainCompute", "probe_train_compute"]

MEMORY_SHARE = 0.25
"""Most of the device's free memory (RAM on the CPU) the probe's two copies may
take, weights, gradients and activations together; a larger model is not probed."""
SPAN = 2
"""Blocks between the two timed copies (1 and ``1 + SPAN`` blocks): the block time is their
difference over ``SPAN``, so timing noise weighs ``1 / SPAN`` on it."""
MIN_EFFICIENCY, MAX_EFFICIENCY = 0.05, 1.5
"""Range the measured efficiency is clipped to (a disturbed probe must not derail a plan)."""


@dataclass(frozen=True)
class TrainCompute:
    """What one micro-batch's training pass of the model costs on this device."""

    block_s: float
    """Forward + backward of one block (no recompute), seconds."""
    rest_s: float
    """Forward + backward of everything outside the blocks (embedding, final norm,
    head, loss), seconds."""
    pass_s: float
    """The whole model's forward + backward, ``num_blocks * block_s + rest_s``, seconds."""
    tflops: float
    """Model FLOPs of that pass over ``pass_s``, TFLOP/s."""
    efficiency: float
    """``tflops`` over the hardware profile's ``device_flops`` (clipped to
    [:data:`MIN_EFFICIENCY`, :data:`MAX_EFFICIENCY`])."""

    def describe(self, hw: HardwareProfile) -> str:
        """One line for the log."""
        return (
            f"model-shaped compute probe: one block {self.block_s * 1e3:.1f} ms, embedding + "
            f"head + loss {self.rest_s * 1e3:.1f} ms per micro-batch (forward + backward); "
            f"{self.tflops:.3g} TFLOP/s = {self.efficiency:.2f} x the matrix-product probe's "
            f"{hw.device_flops / 1e12:.3g} TFLOP/s"
        )


def _with_layers(config: Any, layers: int) -> Any:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers  # every HF config maps this name (attribute_map)
    cfg.use_cache = False
    return cfg


def _fits(model: ModelProfile, seq_len: int, micro_batch: int, device: torch.device) -> bool:
    """Whether the one- and three-block copies (weights, gradients, activations) fit
    :data:`MEMORY_SHARE`."""
    rest = model.embed_params + model.head_params + model.final_params
    params = (SPAN + 2) * model.block_params + 2 * rest  # the one- and three-block copies
    tokens = seq_len * micro_batch
    need = 2 * 2 * params  # bf16 weights and gradients
    need += 2 * tokens * model.act_bytes_per_token_full + 3 * 4 * tokens * model.vocab_size
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = psutil.virtual_memory().available
    return need <= MEMORY_SHARE * free


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass_seconds(
    config: Any,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> tuple[float, float]:
    """Median seconds of a forward + backward pass through the one- and the three-block
    model, timed alternately (after one warm-up pass each) so that a disturbance on
    the machine falls on both."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        nets = [
            AutoModelForCausalLM.from_config(_with_layers(config, layers), dtype=dtype)
            for layers in (1, SPAN + 1)
        ]
    times: list[list[float]] = [[], []]
    try:
        for k in range(repeats + 1):
            for net, out in zip(nets, times, strict=True):
                net.train()
                _sync(device)
                t0 = time.perf_counter()
                net(input_ids=tokens, labels=tokens).loss.backward()
                _sync(device)
                if k:
                    out.append(time.perf_counter() - t0)
                net.zero_grad(set_to_none=True)
    finally:
        del nets
    return statistics.median(times[0]), statistics.median(times[1])


def probe_train_compute(
    config: Any,
    hw: HardwareProfile,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    repeats: int = 3,
) -> TrainCompute | None:
    """Time the model's training pass at ``micro_batch`` sequences of ``seq_len`` tokens.

    ``config`` is the model's Hugging Face config (or anything
    :func:`bb_lightning.structure.load_config` reads). Returns None when the
    copies would not fit :data:`MEMORY_SHARE` of the free memory. Takes
    ``2 * (repeats + 1)`` passes, alternating a one- and a three-block model (a few seconds on
    a CPU for a 370M-parameter model at 512 tokens).
    """
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(
            f"seq_len={seq_len}, micro_batch={micro_batch}: both must be >= 1 to probe"
        )
    from bb_lightning.structure import load_config

    config = load_config(config)
    dev = torch.device(device if device is not None else hw.device_type)
    model = ModelProfile.from_config(config)
    if not _fits(model, seq_len, micro_batch, dev):
        return None
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.vocab_size)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        one, more = _pass_seconds(config, tokens, dtype, dev, repeats)
    block = max(more - one, 0.0) / SPAN
    rest = max(one - block, 0.0)
    total = model.num_blocks * block + rest
    flops = micro_batch * seq_len * cost.train_flops_per_token(model, seq_len, False)
    tflops = flops / max(total, 1e-9) / 1e12
    eff = tflops * 1e12 / max(hw.device_flops, 1.0)
    eff = min(max(eff, MIN_EFFICIENCY), MAX_EFFICIENCY)
    return TrainCompute(block_s=block, rest_s=rest, pass_s=total, tflops=tflops, efficiency=eff)
