"""Time the model's own training pass on the device: a compute efficiency for the planner.

The hardware probe (:mod:`bb_lightning.probe.measure`) times bare square matrix products. A
training step of a real model also runs norms, activations, rotary embeddings, attention and the
loss, and its matrix products have the model's (often smaller) shapes; on a CPU that step
sustains well under the probe's rate. :func:`probe_train_compute` measures it before the first
step: it builds the model's architecture from its config with one and with three blocks (random
weights, the compute dtype, on the device), times a forward + backward of one micro-batch
through each (alternating with a square matrix product, the fastest of a few passes each), and
takes half the difference as one block's time and the rest as the embedding, final norm, head
and loss, with the host kernels a fit there runs
(:func:`~bb_lightning.engine.train_kernels.install`; their rates recorded apart). The full
model's pass is then ``num_blocks * block + rest``, and its FLOPs
(:func:`~bb_lightning.planner.cost.train_flops_per_token`, no recompute) over that time, divided
by the probe's ``device_flops``, is the efficiency the planner multiplies ``device_flops`` by.

:func:`probe_predict_compute` does the same for generation, forward only: a prefill of whole
prompts (the last token's logits only, as the generator asks) and a decode pass of one token
per sequence over a static KV cache of the generator's length, through the attention the
generator uses (:func:`~bb_lightning.engine.attention.decode_attention` on the CPU, ``sdpa``
on CUDA) and, on a CPU device, the compiled kernels it gives the model
(:func:`~bb_lightning.engine.inference.host_kernels`). The prefill's rate gives
``compute_efficiency``; the decode pass's over the prefill's ``decode_efficiency``.

Both probes check their passes (:mod:`bb_lightning.probe.contention`): the fastest
pass of each series must be matched by another within ``SPREAD``, and the matrix
products timed between the model's passes must run at ``DRIFT`` x the profile's
``device_flops`` or more (their median: one lucky product among slowed ones does not
pass). While a check fails they take another round of passes
(``MAX_ROUNDS`` in all); still failing, they warn in one line and take, in this order:
the rates an undisturbed probe of the same model and shape recorded on this machine
(:mod:`bb_lightning.probe.rate_cache`); on a CPU whose other processes left one of its
cores alone, the passes and a matrix product timed again with one thread pinned to that
core, the model's rate taken relative to that product's (a neighbour spinning on one of two
cores slowed the passes several fold, and on a first run the hardware profile was measured
beside it too, so the products beside the passes showed no drift; one thread's time counted
at the thread count's worth credited the passes with a perfect division among the threads,
faster than the engine ran); the model's rate relative to the matrix products timed beside
it, which a busy neighbour slows alike; else the fastest passes. Measured steps re-plan
after warm-up. The rounds, their checks and the timing on a quiet core are
:mod:`bb_lightning.probe.timed_passes`'s.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from bb_lightning.engine import train_attention, train_kernels
from bb_lightning.planner import cost
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.probe import contention, rate_cache
from bb_lightning.probe.contention import Timing
from bb_lightning.probe.machine import cuda_device_memory
from bb_lightning.probe.model import model_profile_from_config
from bb_lightning.probe.timed_passes import Passes, sync, timed_rounds

__all__ = ["PredictCompute", "TrainCompute", "probe_predict_compute", "probe_train_compute"]

MEMORY_SHARE = 0.25
"""Most of the device's free memory (RAM on the CPU) the probe's two copies may
take, weights, gradients and activations together; a larger model is not probed."""
SPAN = 2
"""Blocks between the two timed copies (1 and ``1 + SPAN`` blocks): the block time is their
difference over ``SPAN``, so timing noise weighs ``1 / SPAN`` on it."""
TRAIN_SPANS = (6, 2)
"""Blocks between the training probe's two timed copies, the first whose copies fit
:data:`MEMORY_SHARE` (at most the model's blocks less one, at least :data:`SPAN`): a wider
span weighs the timing noise less and keeps more of a block's activations out of the
cache, as in the whole model: with a span of 6 a block's time varied less from probe to
probe and came closer to a block of the whole model's step than with 2."""
MIN_EFFICIENCY, MAX_EFFICIENCY = 0.05, 1.5
"""Range the measured efficiency is clipped to (a disturbed probe must not derail a plan).
A model computing in another dtype than bf16 may go as far above as that dtype's matrix
products run faster than bf16's (:func:`dtype_ceiling`)."""


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
    [:data:`MIN_EFFICIENCY`, :data:`MAX_EFFICIENCY`]); over the rate of the matrix products
    timed beside the passes when the probe stayed disturbed (see ``note``)."""
    note: str | None = None
    """Why the passes are not to be trusted (the warning the probe gave), or None."""

    def describe(self, hw: HardwareProfile) -> str:
        """One line for the log."""
        return (
            f"model-shaped compute probe: one block {self.block_s * 1e3:.1f} ms, embedding + "
            f"head + loss {self.rest_s * 1e3:.1f} ms per micro-batch (forward + backward); "
            f"{self.tflops:.3g} TFLOP/s = {self.efficiency:.2f} x the matrix-product probe's "
            f"{hw.device_flops / 1e12:.3g} TFLOP/s"
        )

    def applied_to(self, hw: HardwareProfile) -> HardwareProfile:
        """``hw`` with this probe's ``compute_efficiency``."""
        return hw.replace(compute_efficiency=self.efficiency)


def _with_layers(config: Any, layers: int) -> Any:
    """``config`` with ``layers`` blocks: its per-layer lists of layer kinds (``layer_types``
    of a hybrid model, any list of names as long as its blocks) cycled to that length."""
    cfg = copy.deepcopy(config)
    count = getattr(config, "num_hidden_layers", None)
    if isinstance(count, int) and count > 0:
        for key, value in list(vars(cfg).items()):
            if (
                isinstance(value, (list, tuple))
                and len(value) == count
                and all(isinstance(v, str) for v in value)
            ):
                setattr(cfg, key, type(value)(value[i % count] for i in range(layers)))
    cfg.num_hidden_layers = layers  # every HF config maps this name (attribute_map)
    cfg.use_cache = False
    return cfg


def _fits(
    model: ModelProfile, seq_len: int, micro_batch: int, device: torch.device, span: int
) -> bool:
    """Whether the one- and ``1 + span``-block copies (weights, gradients, activations) fit
    :data:`MEMORY_SHARE`."""
    rest = model.embed_params + model.head_params + model.final_params
    params = (span + 2) * model.block_params + 2 * rest  # the two copies
    tokens = seq_len * micro_batch
    need = 2 * 2 * params  # bf16 weights and gradients
    # one copy runs at a time: the wider one's activations, and the fp32 logits and loss
    need += (span + 1) * tokens * model.act_bytes_per_token_full
    need += 3 * 4 * tokens * model.vocab_size
    if device.type == "cuda":  # within set_per_process_memory_fraction's cap
        free = cuda_device_memory(device)
    else:
        free = psutil.virtual_memory().available
    return need <= MEMORY_SHARE * free


def product_rate(dtype: torch.dtype, device: torch.device, n: int = 1024) -> float:
    """FLOP/s of the fastest of three ``n``-square matrix products ``a @ b^T`` in ``dtype``
    (after one warm-up), ``2 n^3`` FLOPs each."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(4):  # the first one warms up
        start = time.perf_counter()
        torch.matmul(a, b.t(), out=out)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / max(best, 1e-9)


def dtype_ceiling(dtype: torch.dtype, device: torch.device) -> float:
    """Highest efficiency a model computing in ``dtype`` may be credited with:
    :data:`MAX_EFFICIENCY` times how much faster a ``dtype`` matrix product runs than a
    bf16 one (:func:`product_rate`, timed back to back, so that a busy neighbour slows
    both), when it does. ``device_flops`` is a bf16 rate; a CPU without bf16 matrix
    instructions (AVX2 only) multiplies fp32 several times faster than bf16, so an fp32 model
    there runs far above it. bf16 needs no product."""
    if dtype == torch.bfloat16:
        return MAX_EFFICIENCY
    ratio = product_rate(dtype, device) / max(product_rate(torch.bfloat16, device), 1.0)
    return MAX_EFFICIENCY * max(1.0, ratio)


FP32_ADVICE_RATIO = 2.0
"""fp32 products this many times faster than bf16 ones make a bf16 job on a CPU worth a
warning (:func:`fp32_advice`)."""


def fp32_advice(device: torch.device) -> str | None:
    """On a CPU whose fp32 matrix products run :data:`FP32_ADVICE_RATIO` x or more faster
    than its bf16 ones (no bf16 matrix instructions: AVX2 only), a line saying so and how
    to compute in fp32; None elsewhere (other devices, CPUs with AVX-512 bf16 or AMX)."""
    if device.type != "cpu":
        return None
    bf16, fp32 = product_rate(torch.bfloat16, device), product_rate(torch.float32, device)
    if fp32 < FP32_ADVICE_RATIO * bf16:
        return None
    return (
        f"balance_beam: this CPU multiplies bf16 matrices at {bf16 / 1e12:.3g} TFLOP/s and "
        f"fp32 at {fp32 / 1e12:.3g} TFLOP/s (no bf16 matrix instructions): compute in fp32 "
        f"for about {fp32 / bf16:.1f} x the speed (Trainer(precision='32-true'), "
        "--trainer.precision=32-true)"
    )


def _pass_seconds(
    config: Any,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    hw: HardwareProfile,
    repeats: int,
    timing: Timing,
    recorded: bool = False,
    span: int = SPAN,
) -> Passes:
    """Fastest seconds of a forward + backward pass through the one- and the ``1 + span``-block
    model (``"one"``, ``"more"``), timed alternately with a matrix product so that a
    disturbance on the machine falls on all; the kernels a fit there runs installed meanwhile."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        nets = [
            AutoModelForCausalLM.from_config(_with_layers(config, layers), dtype=dtype).train()
            for layers in (1, span + 1)
        ]
    undo: list[Callable[[], None]] = []

    def train_pass(net: Any) -> Callable[[], None]:
        undo.append(train_kernels.install_model(device, net))

        def run() -> None:
            sync(device)
            net(input_ids=tokens, labels=tokens).loss.backward()
            sync(device)
            net.zero_grad(set_to_none=True)

        return run

    try:
        passes = [("one", train_pass(nets[0])), ("more", train_pass(nets[1]))]
        return timed_rounds(
            passes, device, hw, repeats, timing, "model-shaped compute probe", recorded, dtype,
            ceiling_of=dtype_ceiling,
        )  # fmt: skip
    finally:
        train_kernels.undo_all(undo)  # a model file's rotary swap holds the process
        del nets


def probe_train_compute(
    config: Any,
    hw: HardwareProfile,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    repeats: int = 3,
    timing: Timing | None = None,
) -> TrainCompute | None:
    """Time the model's training pass at ``micro_batch`` sequences of ``seq_len`` tokens.

    ``config`` is the model's Hugging Face config (or anything :func:`bb_lightning.hf.
    structure.load_config` reads). Returns None when the copies would not fit
    :data:`MEMORY_SHARE` of the free memory. Takes
    ``2 * (repeats + 1)`` passes, alternating a one-block model and one of up to seven blocks
    (three where seven do not fit, :data:`TRAIN_SPANS`) and a matrix product (seconds on a
    small CPU for a model of a few hundred million parameters), and up to
    ``contention.MAX_ROUNDS`` x as many while they are unsteady (see the module doc).
    ``timing`` times the passes (default: the real clock).
    """
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(
            f"seq_len={seq_len}, micro_batch={micro_batch}: both must be >= 1 to probe"
        )
    from bb_lightning.hf.structure import load_config

    config = load_config(config)
    dev = torch.device(device if device is not None else hw.device_type)
    model = model_profile_from_config(config)
    spans = [min(s, max(model.num_blocks - 1, SPAN)) for s in TRAIN_SPANS]  # no wider than it
    span = next((s for s in spans if _fits(model, seq_len, micro_batch, dev, s)), None)
    if span is None:
        return None
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.vocab_size)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(dev)
    record = rate_cache.key(
        "train", model, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, device=dev.type,
        span=span, attention=train_attention.backward_kind(dev, dtype, model.head_dim, seq_len),
        norm=train_kernels.backward_kinds(dev, dtype),
    )  # fmt: skip
    known = (rate_cache.recall(record) or {}).get("train")
    restore = train_attention.install(dev)  # the attention a fit on this device runs
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            passes = _pass_seconds(
                config, tokens, dtype, dev, hw, repeats, timing or contention.SYSTEM,
                known is not None, span,
            )  # fmt: skip
    finally:
        restore()
    one, more = passes.best["one"], passes.best["more"]
    block = max(more - one, 0.0) / span
    rest = max(one - block, 0.0)
    total = model.num_blocks * block + rest
    flops = micro_batch * seq_len * cost.train_flops_per_token(model, seq_len, False)
    rate = flops / max(total, 1e-9)
    peak = _peak(hw, passes)
    if passes.note is None:
        rate_cache.remember(record, {"train": rate})
    elif known is not None:  # disturbed: the undisturbed probe's rate, its times scaled
        block, rest, total = (t * rate / known for t in (block, rest, total))
        rate, peak = known, hw.device_flops
    eff = min(
        max(rate / max(peak, 1.0), MIN_EFFICIENCY), passes.ceiling_for(dtype, dev, dtype_ceiling)
    )
    return TrainCompute(
        block_s=block, rest_s=rest, pass_s=total, tflops=rate / 1e12, efficiency=eff,
        note=passes.note,
    )  # fmt: skip


def _peak(hw: HardwareProfile, passes: Passes) -> float:
    """The FLOP/s efficiencies are relative to: the profile's, or, when the matrix products
    timed beside the passes stayed slower than it (a busy device), theirs."""
    return passes.reference_flops if passes.drifted else hw.device_flops


PREFILL_PROBE_TOKENS = 2048
"""Prompt tokens the predict probe's prefill pass carries at most (whole prompts)."""


@dataclass(frozen=True)
class PredictCompute:
    """What a generation batch's prefill and decode passes cost on this device."""

    prefill_block_s: float
    """Prefill of ``prefill_rows`` prompts through one block, seconds."""
    prefill_rest_s: float
    """The same prefill outside the blocks (embedding, final norm, last-token head), seconds."""
    prefill_rows: int
    """Prompts in the probed prefill pass."""
    prefill_s: float
    """The whole model's prefill, ``num_blocks * prefill_block_s + prefill_rest_s``, seconds."""
    decode_block_s: float
    """One decode pass of ``decode_rows`` sequences through one block, seconds."""
    decode_rest_s: float
    """The same decode pass outside the blocks, seconds."""
    decode_rows: int
    """Sequences in the probed decode pass."""
    decode_s: float
    """The whole model's decode pass, ``num_blocks * decode_block_s + decode_rest_s``, seconds."""
    efficiency: float
    """Prefill FLOPs over the prefill pass time, over ``device_flops`` (clipped): the
    profile's ``compute_efficiency``."""
    decode_efficiency: float
    """The decode pass's rate relative to the prefill's (clipped): the profile's
    ``decode_efficiency``."""
    note: str | None = None
    """Why the passes are not to be trusted (the warning the probe gave), or None."""

    def describe(self, hw: HardwareProfile) -> str:
        """One line for the log."""
        return (
            f"model-shaped predict probe: one block {self.prefill_block_s * 1e3:.1f} ms per "
            f"prefill of {self.prefill_rows} prompts, {self.decode_block_s * 1e3:.1f} ms per "
            f"decode pass of {self.decode_rows} sequences; prefill at {self.efficiency:.2f} x "
            f"the matrix-product probe's {hw.device_flops / 1e12:.3g} TFLOP/s, decode at "
            f"{self.decode_efficiency:.2f} x the prefill rate"
        )

    def applied_to(self, hw: HardwareProfile) -> HardwareProfile:
        """``hw`` with this probe's ``compute_efficiency`` and ``decode_efficiency``."""
        return hw.replace(
            compute_efficiency=self.efficiency, decode_efficiency=self.decode_efficiency
        )


def _predict_fits(
    model: ModelProfile,
    rows: int,
    prompt_len: int,
    dec_rows: int,
    cache_len: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> bool:
    rest = model.embed_params + model.head_params + model.final_params
    scale = torch.empty(0, dtype=dtype).element_size() / 2  # the profile counts bf16 bytes
    need = 2 * scale * ((SPAN + 2) * model.block_params + 2 * rest)  # compute-dtype weights
    need += scale * rows * prompt_len * model.act_bytes_per_token_full
    need += scale * (SPAN + 2) * dec_rows * cache_len * model.kv_bytes_per_token
    need += 4 * max(rows, dec_rows) * model.vocab_size
    free = cuda_device_memory(dev) if dev.type == "cuda" else psutil.virtual_memory().available
    return need <= MEMORY_SHARE * free


def _predict_seconds(
    config: Any,
    prompts: torch.Tensor,
    decode_rows: int,
    cache_len: int,
    last: int,
    dtype: torch.dtype,
    device: torch.device,
    hw: HardwareProfile,
    repeats: int,
    timing: Timing,
    recorded: bool = False,
) -> Passes:
    """Fastest seconds of a prefill and of a decode pass through the one- and the three-block
    model (labels ``"prefill one"``, ``"prefill more"``, ``"decode one"``, ``"decode
    more"``), timed alternately with a matrix product; the decode token sits at ``last``."""
    from transformers import AutoModelForCausalLM, StaticCache

    from bb_lightning.engine.attention import decode_attention_for
    from bb_lightning.engine.hf_quirks import forward_options, unread_outputs_off
    from bb_lightning.engine.inference import host_kernels

    with torch.device(device):
        nets = [
            AutoModelForCausalLM.from_config(_with_layers(config, layers), dtype=dtype).eval()
            for layers in (1, SPAN + 1)
        ]
    undo = [host_kernels(net, dtype) for net in nets] if device.type == "cpu" else []
    token = prompts[:1, :1].expand(decode_rows, 1).contiguous()
    step = {
        "input_ids": token,
        "attention_mask": torch.ones(decode_rows, cache_len, dtype=torch.long, device=device),
        "position_ids": torch.full((decode_rows, 1), last, device=device),
        "cache_position": torch.tensor([last], device=device),
        "use_cache": True,
    }
    try:
        with torch.inference_mode():
            caches = [StaticCache(config=net.config, max_cache_len=cache_len) for net in nets]
            cache_kw, logits_kw = forward_options(nets[0])
            last_only = {"logits_to_keep": 1} if logits_kw else {}
            last_only.update(unread_outputs_off(nets[0]))

            def prefill(net: Any) -> Callable[[], None]:
                def run() -> None:
                    sync(device)
                    with decode_attention_for(net):
                        net(input_ids=prompts, use_cache=False, **last_only)
                    sync(device)

                return run

            def decode(net: Any, cache: Any) -> Callable[[], None]:
                def run() -> None:
                    # the step's cost does not depend on what the cache holds: it attends
                    # over the positions up to ``last``, as the engine's decode step at
                    # that position does on a CPU (the whole cache on an accelerator)
                    sync(device)
                    with decode_attention_for(net):
                        net(**step, **{cache_kw: cache}, **last_only)
                    sync(device)

                return run

            passes: list[tuple[str, Callable[[], None]]] = []
            for name, net, cache in zip(("one", "more"), nets, caches, strict=True):
                passes += [
                    (f"prefill {name}", prefill(net)),
                    (f"decode {name}", decode(net, cache)),
                ]
            what = "model-shaped predict probe"
            return timed_rounds(
                passes, device, hw, repeats, timing, what, recorded, dtype, ceiling_of=dtype_ceiling
            )
    finally:
        for restore in undo:  # the kernels a generation gives the model on a CPU device
            restore()
        del nets


def _split(one: float, more: float, blocks: int) -> tuple[float, float, float]:
    """(block, rest, whole model) seconds from the one- and the ``1 + SPAN``-block times."""
    block = max(more - one, 0.0) / SPAN
    rest = max(one - block, 0.0)
    return block, rest, blocks * block + rest


def _clip(eff: float) -> float:
    return min(max(eff, MIN_EFFICIENCY), MAX_EFFICIENCY)


def _predict_flops(
    model: ModelProfile, rows: int, prompt_len: int, concurrent: int, context: float
) -> tuple[float, float]:
    """FLOPs of the probe's prefill pass (``rows`` prompts of ``prompt_len`` tokens, the head
    on each prompt's last token only) and of its decode pass (one token of each of
    ``concurrent`` sequences attending ``context`` tokens)."""
    head = model.head_flops_per_token()
    pre_flops = rows * prompt_len * (cost.forward_flops_per_token(model, prompt_len) - head)
    return pre_flops + rows * head, concurrent * cost.forward_flops_per_token(model, context)


def probe_predict_compute(
    config: Any,
    hw: HardwareProfile,
    *,
    prompt_len: int,
    concurrent: int,
    cache_len: int,
    context: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    repeats: int = 3,
    timing: Timing | None = None,
) -> PredictCompute | None:
    """Time the model's prefill and decode passes at a generation batch's shapes.

    Args:
        config: the model's Hugging Face config (anything
            :func:`bb_lightning.hf.structure.load_config` reads).
        hw: the hardware profile whose ``device_flops`` the rates are relative to.
        prompt_len: tokens per prompt.
        concurrent: sequences per decode pass (the plan's ``concurrent_seqs``).
        cache_len: positions of the generator's static KV cache.
        context: mean attended context (tokens) the planner counts decode FLOPs at; the
            decode pass is timed with its token at that position (None: ``cache_len``).
        dtype, device: compute dtype and device (default: the profile's device type).
        repeats: timed passes of each shape and model per round (after one warm-up); up to
            ``contention.MAX_ROUNDS`` rounds while they are unsteady (see the module doc).
        timing: times the passes (default: the real clock).

    The prefill pass carries ``min(concurrent, PREFILL_PROBE_TOKENS // prompt_len)``
    prompts (at least one). Returns None when the copies and the cache would not fit
    :data:`MEMORY_SHARE` of the free memory.
    """
    if min(prompt_len, concurrent, cache_len, repeats) < 1:
        raise ValueError(
            f"prompt_len={prompt_len}, concurrent={concurrent}, cache_len={cache_len}, "
            f"repeats={repeats}: all must be >= 1 to probe"
        )
    from bb_lightning.hf.structure import load_config

    config = load_config(config)
    dev = torch.device(device if device is not None else hw.device_type)
    model = model_profile_from_config(config)
    rows = max(1, min(concurrent, PREFILL_PROBE_TOKENS // prompt_len))
    if not _predict_fits(model, rows, prompt_len, concurrent, cache_len, dtype, dev):
        return None
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, int(model.vocab_size), (rows, prompt_len), generator=gen).to(dev)
    # the decode token's position: the mean context (a CPU decode step reads the cache
    # up to the token, an accelerator's sdpa the whole cache), within the cache and the
    # model's positions
    reach = cache_len if context is None else max(1, round(context))
    last = min(reach, cache_len, model.max_positions or cache_len) - 1
    record = rate_cache.key(
        "predict", model, prompt_len=prompt_len, rows=rows, concurrent=concurrent,
        cache_len=cache_len, context=context, decode_position=last, dtype=dtype,
        device=dev.type, host_kernels=dev.type == "cpu",  # inference.host_kernels on a CPU
    )  # fmt: skip
    known = rate_cache.recall(record)
    if known is not None and not {"prefill", "decode"} <= known.keys():
        known = None  # an incomplete record is no record
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        passes = _predict_seconds(
            config, prompts, concurrent, cache_len, last, dtype, dev, hw, repeats,
            timing or contention.SYSTEM, known is not None,
        )  # fmt: skip
    n, best = model.num_blocks, passes.best
    pre_block, pre_rest, pre_total = _split(best["prefill one"], best["prefill more"], n)
    dec_block, dec_rest, dec_total = _split(best["decode one"], best["decode more"], n)
    ctx = float(cache_len if context is None else context)
    pre_flops, dec_flops = _predict_flops(model, rows, prompt_len, concurrent, ctx)
    peak = max(_peak(hw, passes), 1.0)
    pre_rate = pre_flops / max(pre_total, 1e-9)
    dec_rate = dec_flops / max(dec_total, 1e-9)
    if passes.note is None:
        rate_cache.remember(record, {"prefill": pre_rate, "decode": dec_rate})
    elif known is not None:
        # disturbed: the undisturbed probe's rates, its times scaled to them
        pre_block, pre_rest, pre_total = (
            t * pre_rate / known["prefill"] for t in (pre_block, pre_rest, pre_total)
        )
        dec_block, dec_rest, dec_total = (
            t * dec_rate / known["decode"] for t in (dec_block, dec_rest, dec_total)
        )
        pre_rate, dec_rate, peak = known["prefill"], known["decode"], max(hw.device_flops, 1.0)
    eff = min(max(pre_rate / peak, MIN_EFFICIENCY), passes.ceiling_for(dtype, dev, dtype_ceiling))
    return PredictCompute(
        prefill_block_s=pre_block,
        prefill_rest_s=pre_rest,
        prefill_rows=rows,
        prefill_s=pre_total,
        decode_block_s=dec_block,
        decode_rest_s=dec_rest,
        decode_rows=concurrent,
        decode_s=dec_total,
        efficiency=eff,
        decode_efficiency=_clip(dec_rate / (eff * peak)),
        note=passes.note,
    )
