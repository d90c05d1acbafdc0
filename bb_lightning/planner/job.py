"""What to plan for: a fine-tuning job (:class:`FitJob`) or a bulk generation job
(:class:`PredictJob`). Frozen data, validated on construction and against a model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bb_lightning.placement import DTYPE_BYTES
from bb_lightning.planner.profile import ModelProfile
from bb_lightning.shapes import CACHE_ROUND, cache_length

__all__ = ["CACHE_ROUND", "FitJob", "PredictJob", "cache_length"]


def _positive(cls: str, name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{cls}.{name} = {value!r} must be a positive integer (>= 1)")


def _dtype(cls: str, value: str) -> None:
    if value not in DTYPE_BYTES:
        raise ValueError(
            f"{cls}.compute_dtype = {value!r} is not supported: use one of {sorted(DTYPE_BYTES)} "
            "(the Trainer's precision: 'bf16-true' -> 'bfloat16', '32-true' -> 'float32')"
        )


@dataclass(frozen=True, kw_only=True)
class FitJob:
    """Fine-tuning with AdamW of the parameters the model profile trains (all of them, or
    LoRA adapters: see ``ModelProfile.block_trainable_params``).

    Give exactly one of ``global_batch_tokens`` and ``global_batch_seqs``: the
    global batch is a training hyper-parameter, the planner only splits it into
    micro-batches and gradient accumulation steps.
    """

    seq_len: int
    """Tokens per training sequence."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step (rounded up to whole sequences)."""
    global_batch_seqs: int | None = None
    """Sequences per optimizer step."""
    optimizer: str = "adamw"
    """Optimizer; only ``"adamw"`` (fp32 master weights and two fp32 moments) is modelled."""
    checkpointing: bool | None = None
    """Per-block activation checkpointing: ``None`` lets the planner choose."""
    grad_clipping: bool = False
    """Gradient clipping (Lightning's ``gradient_clip_val`` set): the clip needs every
    gradient first, so no block steps during backward (see ``grad_clip_algorithm``)."""
    grad_clip_algorithm: str = "norm"
    """``"norm"`` (global 2-norm: one rank steps the blocks after backward, beside the next
    forward) or ``"value"`` (element-wise: every block steps after backward, exposed)."""
    compute_dtype: str = "bfloat16"
    """Dtype the device computes in (weights, their copies and gradients), a key of
    :data:`~bb_lightning.placement.DTYPE_BYTES`."""
    loss_chunk_tokens: int | None = None
    """Tokens whose logits the training loss holds at once, when its head and cross-entropy
    run in chunks (``CausalLMModule``'s ``loss_chunk_tokens``); None: the whole pass's, as
    transformers' loss holds them for a module that calls the model with ``labels``."""

    def __post_init__(self) -> None:
        _positive("FitJob", "seq_len", self.seq_len)
        if self.loss_chunk_tokens is not None:
            _positive("FitJob", "loss_chunk_tokens", self.loss_chunk_tokens)
        _dtype("FitJob", self.compute_dtype)
        if self.grad_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                f"FitJob.grad_clip_algorithm = {self.grad_clip_algorithm!r} is not supported: "
                "use 'norm' or 'value' (Lightning's gradient_clip_algorithm)"
            )
        if (self.global_batch_tokens is None) == (self.global_batch_seqs is None):
            raise ValueError(
                f"FitJob: global_batch_tokens = {self.global_batch_tokens!r} and "
                f"global_batch_seqs = {self.global_batch_seqs!r}: give exactly one of them"
            )
        if self.global_batch_tokens is not None:
            _positive("FitJob", "global_batch_tokens", self.global_batch_tokens)
        if self.global_batch_seqs is not None:
            _positive("FitJob", "global_batch_seqs", self.global_batch_seqs)
        if self.optimizer != "adamw":
            raise ValueError(f"FitJob.optimizer = {self.optimizer!r}: only 'adamw' is modelled")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def seqs_per_step(self) -> int:
        """Sequences per optimizer step."""
        if self.global_batch_seqs is not None:
            return self.global_batch_seqs
        assert self.global_batch_tokens is not None
        return max(1, math.ceil(self.global_batch_tokens / self.seq_len))

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step."""
        return self.seqs_per_step * self.seq_len

    def validate(self, model: ModelProfile) -> None:
        """Raise ``ValueError`` when the job does not suit ``model``."""
        if model.max_positions and self.seq_len > model.max_positions:
            raise ValueError(
                f"seq_len = {self.seq_len} tokens exceeds {model.name}'s context of "
                f"{model.max_positions} tokens: use seq_len <= {model.max_positions}"
            )


@dataclass(frozen=True, kw_only=True)
class PredictJob:
    """Bulk greedy generation: ``num_prompts`` prompts, each extended by ``new_tokens``."""

    prompt_len: int
    """Tokens per prompt (prompts are padded to this length)."""
    new_tokens: int
    """Tokens generated per prompt."""
    num_prompts: int
    """Prompts in the whole job."""
    compute_dtype: str = "bfloat16"
    """Dtype the device computes in (weights and their copies), a key of
    :data:`~bb_lightning.placement.DTYPE_BYTES`."""

    def __post_init__(self) -> None:
        _dtype("PredictJob", self.compute_dtype)
        _positive("PredictJob", "prompt_len", self.prompt_len)
        _positive("PredictJob", "new_tokens", self.new_tokens)
        _positive("PredictJob", "num_prompts", self.num_prompts)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def total_len(self) -> int:
        """Tokens per sequence at the end of generation."""
        return self.prompt_len + self.new_tokens

    @property
    def cache_len(self) -> int:
        """Positions of the generator's static KV cache: :func:`cache_length` of ``total_len``."""
        return cache_length(self.total_len)

    @property
    def mean_context(self) -> float:
        """Tokens a decode pass attends over on average: ``prompt_len + new_tokens / 2``."""
        return self.prompt_len + self.new_tokens / 2.0

    def validate(self, model: ModelProfile) -> None:
        """Raise ``ValueError`` when the job does not suit ``model``."""
        if model.max_positions and self.total_len > model.max_positions:
            raise ValueError(
                f"prompt_len + new_tokens = {self.total_len} tokens exceeds {model.name}'s "
                f"context of {model.max_positions} tokens: shorten the prompt or generate fewer "
                "tokens"
            )
