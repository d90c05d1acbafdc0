"""DeepSpeed ZeRO-3 with offload as a peer run of ``bench/train_offload.py``.

Not a benchmark itself. DeepSpeed is an optional benchmark dependency (the ``bench``
extra of ``pyproject.toml``); its ``cpu_adam`` and ``async_io`` ops are compiled on
first use (a C++ compiler and ``libaio`` with its headers are needed: Debian's
``libaio-dev``). :func:`unavailable` says why it cannot run here, or None.

The peer trains the same Llama config (random weights, same seed) on the same
random-token micro-batches with the same accumulation and AdamW settings, in the
benchmark's compute dtype (bf16, or fp32 with ``--dtype fp32``; a run whose embedding
hands its first block another dtype stops with an error), in this process:
ZeRO stage 3 with the parameters offloaded to the CPU
(``offload_param.device = "cpu"``) or, with ``weights_on_nvme``, to NVMe, and the
optimizer state (fp32 master weights and AdamW moments) on NVMe under
``nvme_dir``, updated by DeepSpeed's CPU Adam. Parameter prefetch is off and
``stage3_max_live_parameters`` / ``stage3_max_reuse_distance`` are 0, and
``offload_param.max_in_cpu`` is 0, which DeepSpeed 0.19 needs to keep parameters on
NVMe at all. No activation recompute (the activations of the benchmark's model fit
in RAM; recompute would only slow the peer down).

On a CPU-only machine DeepSpeed needs ``DS_ACCELERATOR=cpu`` (set here before the
import unless already set) and a process group: one process on gloo at
127.0.0.1 on a free port.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["ds_config", "train_deepspeed", "unavailable"]

LEARNING_RATE = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.0
"""The AdamW settings of ``CausalLMModule(config, learning_rate=1e-4)``."""


def _environment() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):  # fmt: skip
        os.environ.setdefault(key, value)


def unavailable() -> str | None:
    """Why the DeepSpeed peer cannot run here (one line), or None when it can.

    Imports DeepSpeed and builds (or loads the cached build of) its ``cpu_adam`` and
    ``async_io`` ops; the first call compiles them (a minute or more).
    """
    _environment()
    try:
        deepspeed = importlib.import_module("deepspeed")
    except Exception as err:  # ImportError, or an accelerator it cannot set up
        return (
            f"DeepSpeed does not import ({type(err).__name__}: {err}); install the bench "
            "extra: pip install -e '.[bench]'"
        )
    from deepspeed.accelerator import get_accelerator

    for op in ("CPUAdamBuilder", "AsyncIOBuilder"):
        builder = get_accelerator().create_op_builder(op)
        if builder is None:
            return f"DeepSpeed {deepspeed.__version__} has no {op} for this accelerator"
        if not builder.is_compatible(verbose=False):
            hint = " (install libaio-dev)" if op == "AsyncIOBuilder" else ""
            return f"DeepSpeed's {builder.NAME} op cannot build here{hint}"
        try:
            builder.load(verbose=False)
        except Exception as err:
            hint = " (install libaio-dev)" if op == "AsyncIOBuilder" else ""
            return (
                f"DeepSpeed's {builder.NAME} op failed to build{hint}: {type(err).__name__}: {err}"
            )
    return None


def ds_config(
    *,
    micro_batch: int,
    accumulate: int,
    nvme_dir: Path,
    weights_on_nvme: bool,
    max_param: int,
    bf16: bool = True,
) -> dict[str, Any]:
    """The ZeRO-3 offload config (see the module doc); ``max_param`` is the largest
    parameter's element count (NVMe parameter buffers must hold it); ``bf16`` False
    computes in fp32."""
    if weights_on_nvme:
        param: dict[str, Any] = {
            "device": "nvme", "nvme_path": str(nvme_dir), "pin_memory": False,
            "buffer_count": 5, "buffer_size": max(max_param, 1 << 20), "max_in_cpu": 0,
        }  # fmt: skip
    else:
        param = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulate,
        "bf16": {"enabled": bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LEARNING_RATE,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": param,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(nvme_dir),
                "pin_memory": False,
                "buffer_count": 4,
            },
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0,
            "overlap_comm": False,
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def train_deepspeed(
    config: dict[str, Any],
    batches: list[torch.Tensor],
    *,
    micro_batch: int,
    accumulate: int,
    warmup: int,
    nvme_dir: Path,
    weights_on_nvme: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[float], int]:
    """Seconds of each optimizer step after the first ``warmup`` ones, and the bytes of
    DeepSpeed's swap files under ``nvme_dir`` after the last step.

    ``batches`` are the micro-batches of token ids (``micro_batch`` x seq each),
    ``accumulate`` per optimizer step; the model is built from ``config`` in ``dtype``
    (bf16 or fp32) under ``deepspeed.zero.Init`` with ``torch.manual_seed(seed)``.
    """
    _environment()
    import deepspeed
    from transformers import AutoConfig

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = AutoConfig.for_model(**config)
    probe = cfg.vocab_size * cfg.hidden_size
    max_param = max(probe, cfg.hidden_size * cfg.intermediate_size)
    ds = ds_config(micro_batch=micro_batch, accumulate=accumulate, nvme_dir=nvme_dir,
                   weights_on_nvme=weights_on_nvme, max_param=max_param,
                   bf16=dtype == torch.bfloat16)  # fmt: skip
    # zero.Init patches tensor construction, under which torch._dynamo (imported lazily by
    # the model's module) fails to import: import them first
    importlib.import_module("torch._dynamo")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    torch.manual_seed(seed)
    # the dtype comes from the config's bf16 switch: DeepSpeed 0.19's zero.Init ignores a
    # dtype argument of torch.float32 on an accelerator without fp16 (the CPU's) and makes
    # the parameters bf16, which a CPU without bf16 matrix instructions runs 5-10 x slower
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = model_class._from_config(cfg, dtype=dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    engine.train()
    computed = _ComputeDtype(model)
    seconds: list[float] = []
    start = time.perf_counter()
    try:
        for i, ids in enumerate(batches):
            loss = engine(input_ids=ids, labels=ids).loss
            computed.check(dtype)
            engine.backward(loss)
            engine.step()
            if (i + 1) % accumulate == 0:
                now = time.perf_counter()
                seconds.append(now - start)
                start = now
                what = "warm-up" if len(seconds) <= warmup else "timed"
                print(f"[deepspeed] step {len(seconds)} ({what}): {seconds[-1]:.2f} s", flush=True)
        on_disk = sum(f.stat().st_size for f in nvme_dir.rglob("*") if f.is_file())
    finally:
        computed.remove()
        engine.destroy()
        del engine, model
    return seconds[warmup:], on_disk


class _ComputeDtype:
    """The dtype of the hidden states the model's input embedding hands to its first block:
    what the peer computes in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: torch.dtype | None = None
        embedding = model.get_input_embeddings()

        def hook(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
            self.seen = out.dtype

        self._handle = embedding.register_forward_hook(hook)

    def check(self, dtype: torch.dtype) -> None:
        """Raise ``RuntimeError`` when the last forward computed in another dtype."""
        if self.seen is not None and self.seen != dtype:
            raise RuntimeError(
                f"DeepSpeed computed in {self.seen}, not the benchmark's {dtype}: its "
                "timing would not compare with the other runs'"
            )

    def remove(self) -> None:
        self._handle.remove()
