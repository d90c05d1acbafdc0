"""The runs ``bench/gpu_check.py`` starts in processes of their own: full fine-tuning under
one framework (``balance_beam``, Lightning's FSDP with CPU offload, DeepSpeed ZeRO-3
offload) and bulk generation (``balance_beam``'s engine, then Accelerate's offload), each
with device memory capped by ``torch.cuda.set_per_process_memory_fraction``.

Each returns a dict of figures; the parent reads it from the child's last output line.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

import torch
from gpu_check import GIB, Ctx

PREDICT_DEVICE_CAP = 16 * GIB
"""Device bytes a generation run may use."""


_START = time.perf_counter()


def _note(what: str) -> None:
    """A progress line on stderr, seconds since the child started: a child killed at its
    limit shows how far it got."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {what}", file=sys.stderr, flush=True)


def _cap_device(ctx: Ctx, cap: int) -> None:
    if ctx.cuda:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), ctx.device)


def train_child(ctx: Ctx, framework: str, spec: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl

    from bb_lightning import BalanceBeamStrategy
    from bb_lightning.module import CausalLMModule
    from bb_lightning.planner import cost
    from bb_lightning.probe import measure, model_profile_from_config

    _cap_device(ctx, int(spec["device_cap_gib"] * GIB))
    os.environ["BB_CACHE_DIR"] = str(ctx.out / "cache")  # measured by the measure step
    config = {"model_type": "llama", "hidden_size": spec["hidden"],
              "intermediate_size": spec["ffn"], "num_hidden_layers": spec["layers"],
              "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
              "vocab_size": spec["vocab"], "max_position_embeddings": max(2048, spec["seq"]),
              "tie_word_embeddings": False}  # fmt: skip
    precision = "bf16-true"
    strategy: Any
    if framework == "balance_beam":  # planned on this machine's measured profile
        hw = measure(nvme_path=str(ctx.nvme), max_seconds=ctx.probe_s(10.0))
        strategy = BalanceBeamStrategy(hardware=hw)
    elif framework == "fsdp_cpu_offload":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        layer = {LlamaDecoderLayer}
        strategy = FSDPStrategy(cpu_offload=True, auto_wrap_policy=layer,
                                activation_checkpointing_policy=layer)  # fmt: skip
        precision = "bf16-mixed"  # fp32 parameters on the host, as our master weights
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    module = CausalLMModule(config, learning_rate=1e-5, seed=0)
    _note(f"{framework}: fit starts")
    timer = _step_clock(spec["accum"], ctx)
    steps = spec["steps"]
    trainer = pl.Trainer(
        accelerator="cuda" if ctx.cuda else "cpu", devices=1, strategy=strategy,
        precision=precision, max_steps=steps, accumulate_grad_batches=spec["accum"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, spec["vocab"], (spec["micro"], spec["seq"]), generator=g)}
            for _ in range(steps * spec["accum"])]  # fmt: skip
    at_oom: list[Any] = []  # the allocator's state when it first ran out (before teardown)
    # the stacks of live allocations only in a run retried after running out of memory:
    # recording them slows every allocation, so a timed run never records
    record = ctx.cuda and bool(spec.get("record_memory_history"))
    if record:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if ctx.cuda:
        torch._C._cuda_attach_out_of_memory_observer(
            lambda *_: at_oom.append(torch.cuda.memory._snapshot()) if not at_oom else None
        )
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))  # type: ignore[arg-type, var-annotated]
    except Exception as err:
        if not (at_oom or isinstance(err, torch.OutOfMemoryError)):
            raise
        return _oom_report(strategy, err, at_oom[0] if at_oom else None, record)
    finally:
        if record:
            torch.cuda.memory._record_memory_history(enabled=None)
    timed = timer.ends[1:]  # the first step warms up
    if not timed:
        return {"error": f"{len(timer.ends)} optimizer steps ran: none timed",
                "losses": timer.losses}  # fmt: skip
    seconds = (timed[-1] - timer.ends[0]) / len(timed)
    tokens = spec["micro"] * spec["seq"] * spec["accum"]
    tps = tokens / seconds
    flops = cost.model_flops_per_token(model_profile_from_config(config), "fit", spec["seq"])
    peak = _peak_flops(ctx)
    out = {"tokens_per_s": tps, "step_s": seconds, "tokens_per_step": tokens,
           "mfu": tps * flops / peak if peak else None, "peak_flops": peak,
           "model_flops_per_token": flops, "losses": timer.losses,
           "max_memory_allocated": torch.cuda.max_memory_allocated() if ctx.cuda else None}  # fmt: skip
    if isinstance(strategy, BalanceBeamStrategy):
        if strategy.plan is not None:
            out["predicted_tokens_per_s"] = strategy.plan.tokens_per_s
            out["plan"] = strategy.plan.explain()
        strategy.close()
    return out


POOL = (1 << 24) + 7
"""Values in the pool ``random_weights`` tiles: a prime-ish count, so that tiles do not
line up with rows."""


def random_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in seconds: 1-D weights 1 (norm scales), 1-D biases 0, the
    rest tiled from one pool of N(0, 0.02) values (a throughput check needs no better)."""
    pool = torch.randn(POOL, generator=torch.Generator().manual_seed(seed)) * 0.02
    cast: dict[torch.dtype, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            src = cast.setdefault(p.dtype, pool.to(p.dtype))
            flat = p.view(-1)
            for start in range(0, flat.numel(), POOL):
                n = min(POOL, flat.numel() - start)
                flat[start : start + n].copy_(src[:n])


def _oom_report(strategy: Any, err: BaseException, snapshot: Any, recorded: bool) -> dict[str, Any]:
    """What held the device when fitting ran out of its memory: the bytes allocated, the
    plan's device bytes, and the live blocks of the allocator's ``snapshot`` taken then,
    summed by the innermost frame of this project or of transformers that allocated them
    (frames only when the run ``recorded`` the memory history: the parent then retries
    a run that ran out, recording, ``"oom": True`` says so)."""
    report: dict[str, Any] = {"error": f"CUDA out of memory: {str(err)[:300]}", "oom": True,
                              "allocated": torch.cuda.memory_allocated(),
                              "max_allocated": torch.cuda.max_memory_allocated(),
                              "memory_history": recorded}  # fmt: skip
    plan = getattr(strategy, "plan", None)
    if plan is not None:
        report["planned_device_bytes"] = plan.memory[0].used
        report["plan"] = plan.explain()
    if snapshot is None:
        report["holders"] = "no snapshot was taken when the allocator ran out"
        return report
    held: dict[str, int] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if "bb_lightning" in f["filename"] or "storage/" in f["filename"]
                    or "transformers" in f["filename"]]  # fmt: skip
            top = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
            key = f"{top['filename'].rsplit('/', 2)[-1]}:{top['line']} {top['name']}"
            held[key] = held.get(key, 0) + int(block.get("size", 0))
    report["holders"] = sorted(held.items(), key=lambda kv: -kv[1])[:15]
    return report


def _step_clock(accum: int, ctx: Ctx) -> Any:
    """A Lightning callback noting the wall time at the end of each optimizer step, after
    a device sync (``.ends``)."""
    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.held: list[torch.Tensor] = []  # read after the run: no sync per batch

        @property
        def losses(self) -> list[float]:
            """Each micro-batch's loss as Lightning hands it to callbacks."""
            return [float(t.float().cpu()) for t in self.held]

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            outputs = args[1]
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                self.held.append(loss.detach())
            if (args[-1] + 1) % accum == 0:
                ctx.sync()
                self.ends.append(time.perf_counter())
                _note(f"optimizer step {len(self.ends)} done")

    return StepClock()


def _peak_flops(ctx: Ctx) -> float | None:
    from bb_lightning.probe.machine import datasheet_peak

    return datasheet_peak(ctx.device) or None


def predict_child(ctx: Ctx, spec: dict[str, Any]) -> dict[str, Any]:
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import AutoConfig, AutoModelForCausalLM

    from bb_lightning.engine.budgets import weights_budgets
    from bb_lightning.engine.flat import dtype_name, set_data
    from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
    from bb_lightning.engine.inference import InferenceEngine
    from bb_lightning.hf.structure import find_block_list
    from bb_lightning.planner import PredictJob, make_plan
    from bb_lightning.probe import measure, model_profile_from_module
    from storage.store import StoreConfig, TieredStore
    from storage.tiers import Tier

    _cap_device(ctx, PREDICT_DEVICE_CAP)
    os.environ["BB_CACHE_DIR"] = str(ctx.out / "cache")  # measured by the measure step
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    config = AutoConfig.for_model(
        "opt", hidden_size=spec["hidden"], ffn_dim=spec["ffn"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], word_embed_proj_dim=spec["hidden"],
        vocab_size=50272, max_position_embeddings=2048, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    _note("building the model")
    with torch.device("meta"):  # transformers' own init draws every value: minutes at 6.7 B
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu").eval()
    model.tie_weights()
    random_weights(model, seed=0)
    _note("model built")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50272, (spec["prompts"], spec["prompt_len"]), generator=g)
    mask = torch.ones_like(ids)
    job = PredictJob(prompt_len=spec["prompt_len"], new_tokens=spec["new"],
                     num_prompts=spec["prompts"], compute_dtype=dtype_name(dtype))  # fmt: skip
    hw = measure(nvme_path=str(ctx.nvme), max_seconds=ctx.probe_s(10.0))
    hw = hw.replace(nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0)  # no NVMe
    plan = make_plan(model_profile_from_module(model), hw, job)
    _note(f"planned: {plan.concurrent_seqs} rows at once")
    _, blocks = find_block_list(model)
    placement = plan.placement
    need = weights_budgets([sum(p.numel() for p in b.parameters()) for b in blocks], placement)
    store = TieredStore(StoreConfig(device_budget=need[Tier.DEVICE] + (1 << 20),
                                    host_budget=need[Tier.HOST] + (1 << 20),
                                    device=str(ctx.device)))  # fmt: skip
    # the engine reads the weights through a loader (as from a checkpoint), so that closing
    # it hands the module its own bf16 tensors back rather than fp32 copies
    own = {id(p): p.detach() for p in model.parameters()}
    engine = InferenceEngine(model, list(blocks), store, placement,
                             device=ctx.device, loader=lambda p: own[id(p)])  # fmt: skip
    gen = LayerMajorGenerator(  # the cache where the plan homes it, attended where it says
        model, kv_tier=plan.kv_cache, attention_tier=placement.decode_attention
    )
    _note("engine holds the weights")
    rows = plan.concurrent_seqs
    ours: list[list[int]] = []
    ctx.sync()
    t0 = time.perf_counter()
    for i in range(0, len(ids), rows):
        done = gen.generate(ids[i : i + rows], mask[i : i + rows],
                            GenerationConfig(max_new_tokens=spec["new"]))  # fmt: skip
        ours += [r.token_ids for r in done]
        _note(f"balance_beam: {len(ours)} of {len(ids)} prompts")
    ours_s = time.perf_counter() - t0
    engine.close()
    store.close()
    for p in model.parameters():
        set_data(p, own[id(p)])
    own.clear()
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    budget = (
        {0: int(PREDICT_DEVICE_CAP * 0.9), "cpu": int(1e13)} if ctx.cuda else {"cpu": int(1e13)}
    )
    device_map = infer_auto_device_map(model, max_memory=budget,  # type: ignore[arg-type]
                                       no_split_module_classes=["OPTDecoderLayer"])  # fmt: skip
    model = dispatch_model(model, device_map=device_map)
    _note("accelerate: model dispatched")
    first = ctx.device
    ref: list[list[int]] = []
    ctx.sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(ids), rows):
            out = model.generate(input_ids=ids[i : i + rows].to(first),  # type: ignore[operator]
                                 attention_mask=mask[i : i + rows].to(first), do_sample=False,
                                 max_new_tokens=spec["new"], min_new_tokens=spec["new"],
                                 pad_token_id=1)  # fmt: skip
            ref += out[:, spec["prompt_len"] :].tolist()
            _note(f"accelerate: {len(ref)} of {len(ids)} prompts")
    acc_s = time.perf_counter() - t0
    tokens = spec["prompts"] * spec["new"]
    same = sum(a == b for a, b in zip(ours, ref, strict=True)) / len(ref)
    return {"balance_beam_tokens_per_s": tokens / ours_s,
            "accelerate_tokens_per_s": tokens / acc_s,
            "ratio_balance_beam_over_accelerate": acc_s / ours_s,
            "same_tokens": same, "concurrent_seqs": rows, "plan": plan.explain(),
            "accelerate_devices": sorted({str(v) for v in device_map.values()})}  # fmt: skip
