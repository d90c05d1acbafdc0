"""``CausalLMModule``: any Hugging Face causal LM as a LightningModule.

The model is built in :meth:`CausalLMModule.configure_model`, Lightning's hook
for deferred construction, so a strategy can build it on the meta device and
stream weights into its tiers. :meth:`CausalLMModule.model_config` and
:attr:`CausalLMModule.checkpoint_dir` tell such a strategy what to build and
where the weights are; :meth:`CausalLMModule.adamw_config` gives the optimizer
hyperparameters for a host-side AdamW.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from bb_lightning.bounds import check_int, check_number
from bb_lightning.causal_loss import causal_lm_loss
from bb_lightning.data.tokenizer import Tokenizer, decode_ids, load_tokenizer
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.hf_quirks import resolve_model
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.hf.converted import ConvertedStore, converted_store, load_converted, store_config
from bb_lightning.hf.hf_load import HFCheckpoint, check_supported, empty_model
from bb_lightning.hf.lora import LoraOptions, require_peft, wrap_lora
from bb_lightning.planner.cost import loss_chunk_tokens
from bb_lightning.planner.models import BUILTIN_MODELS
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = [
    "DEFAULT_MODEL",
    "CausalLMModule",
    "LinearWarmup",
    "SafetensorsCheckpoint",
    "resolve_model_config",
]

DEFAULT_MODEL = "tiny-llama"
"""Built-in model (``bb_lightning.planner.models``) used when ``model`` is None."""


def resolve_model_config(
    model: str | os.PathLike[str] | dict[str, Any] | PretrainedConfig | None,
) -> tuple[PretrainedConfig, Path | str | None]:
    """The configuration of ``model`` and where its weights are (None: initialise randomly).

    ``model`` is a built-in name, a local checkpoint directory (``config.json``
    plus weights, or only ``config.json``), a store written by ``bb-lightning convert``
    (its weights are the store's, :mod:`bb_lightning.hf.converted`), a ``config.json`` path,
    a dict with ``model_type``, a ``PretrainedConfig``, or a hub id (needs the network);
    see :func:`bb_lightning.engine.hf_quirks.resolve_model`.
    """
    if isinstance(model, (str, os.PathLike)):
        store = converted_store(model)
        if store is not None:
            return store_config(store), store.path
    resolved = resolve_model(DEFAULT_MODEL if model is None else model, builtins=BUILTIN_MODELS)
    return resolved.config, resolved.weights


SafetensorsCheckpoint = HFCheckpoint
"""Reads single parameters of a local checkpoint (see :mod:`bb_lightning.hf.hf_load`)."""


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed every generator and make new tensors on the CPU for the block, then restore the
    caller's random state.

    The CPU also where a strategy's init context names the accelerator (plain Lightning
    on a GPU builds the model in ``torch.device("cuda")``): a CUDA generator draws other
    numbers from the same seed, so ``seed`` would give other initial weights there than
    under a strategy that builds on the host. The strategy moves the model afterwards.
    """
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda), torch.device("cpu"):
        torch.manual_seed(seed)
        yield


def check_module_settings(
    *,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    warmup_steps: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    stop_strings: list[str] | None,
    loss_chunk_tokens: int | None = None,
) -> None:
    """Refuse :class:`CausalLMModule` settings out of range, one line naming the value."""
    check_number("learning_rate", learning_rate, low=0.0, what="peak AdamW step size",
                 example=1e-4)  # fmt: skip
    check_number("weight_decay", weight_decay, low=0.0, what="decoupled AdamW decay per step",
                 example=0.01)  # fmt: skip
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(
            f"betas={betas!r}: must be two numbers in [0, 1) (AdamW moment decay rates), "
            "e.g. [0.9, 0.95]"
        )
    for i, beta in enumerate(betas):
        check_number(f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True,
                     what="AdamW moment decay rate", example=0.9 + 0.05 * i)  # fmt: skip
    check_number("eps", eps, low=0.0, low_open=True, what="AdamW denominator term",
                 example=1e-8)  # fmt: skip
    check_int("warmup_steps", warmup_steps, low=0, what="optimizer steps of linear warm-up",
              example=10)  # fmt: skip
    check_int("max_new_tokens", max_new_tokens, low=1, what="tokens generated per prompt",
              example=64)  # fmt: skip
    check_number("temperature", temperature, low=0.0, what="sampling temperature; 0: greedy",
                 example=0.8)  # fmt: skip
    check_int("top_k", top_k, low=0, what="most likely tokens sampled from; 0: all",
              example=50)  # fmt: skip
    check_number("top_p", top_p, low=0.0, high=1.0, low_open=True,
                 what="nucleus probability mass; 1: all", example=0.9)  # fmt: skip
    check_int("seed", seed, low=0, high=2**63 - 1, what="seed of initial weights and sampling",
              example=0)  # fmt: skip
    check_int("loss_chunk_tokens", loss_chunk_tokens, low=0, example=1024,
              what="tokens whose logits the loss holds at once; 0: the whole pass",
              none="a chunk chosen from the vocabulary")  # fmt: skip
    for text in stop_strings or []:
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"stop_strings={stop_strings!r}: each must be a non-empty string (a text "
                "that ends a generated sequence), e.g. ['\\n\\n']"
            )


@dataclass(frozen=True)
class LinearWarmup:
    """LR factor rising linearly to 1 over ``warmup_steps`` optimizer steps, then constant.

    Step ``i`` (0-based) gets ``min(1, (i + 1) / warmup_steps)``, so the first
    step already moves. A class rather than a lambda so schedulers pickle.
    """

    warmup_steps: int
    """Optimizer steps to reach the full learning rate."""

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup_steps)


class CausalLMModule(pl.LightningModule):
    """Fine-tune (fit/validate) or bulk-generate (predict) with a causal LM.

    Batches for ``fit``/``validate``: ``{"input_ids": LongTensor[b, s],
    "attention_mask"?: LongTensor[b, s], "labels"?: LongTensor[b, s]}``;
    labels default to ``input_ids`` (the model shifts them). Batches for
    ``predict``: ``{"id": list[str], "input_ids", "attention_mask",
    "error"?: list[str | None]}``, left-padded (see
    :class:`~bb_lightning.data.PromptsDataModule`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | dict[str, Any] | PretrainedConfig | None = None,
        *,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        tokenizer: str | None = None,
        stop_strings: list[str] | None = None,
        lora: dict[str, Any] | None = None,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        """Configure the module; the network is built in :meth:`configure_model`.

        Args:
            model: what to build (see :func:`resolve_model_config`); ``"tiny-llama"`` if None.
            learning_rate: peak AdamW learning rate.
            weight_decay: decoupled AdamW weight decay.
            betas: AdamW moment decay rates.
            eps: AdamW denominator epsilon.
            warmup_steps: optimizer steps of linear warm-up (0: none).
            max_new_tokens: tokens generated per prompt in ``predict``.
            temperature: sampling temperature; 0 means greedy decoding.
            top_k: sample among the k most likely tokens (0: all).
            top_p: nucleus sampling threshold in (0, 1].
            seed: seed of the random initial weights and of sampling.
            tokenizer: ``"byte"`` or a HF tokenizer dir/name to decode predictions; None: ids only.
            stop_strings: texts that end a generated sequence (needs ``tokenizer``).
            lora: train LoRA adapters instead of every weight: ``rank``, ``alpha``,
                ``dropout``, ``target_modules``, ``modules_to_save``
                (see :class:`~bb_lightning.hf.lora.LoraOptions`;
                needs ``pip install 'balance-beam[peft]'``); None: full fine-tuning.
            loss_chunk_tokens: tokens whose logits the training loss holds at once: the
                head and the cross-entropy run over chunks of that many positions, each but
                the last recomputed in backward (:func:`~bb_lightning.causal_loss.causal_lm_loss`);
                None: as many as keep one chunk's fp32 logits and their gradients within
                1 GiB (697 tokens at a 128k vocabulary); 0: the whole pass at once,
                through the model's own ``labels`` loss.
        """
        super().__init__()
        check_module_settings(
            learning_rate=learning_rate, weight_decay=weight_decay, betas=betas, eps=eps,
            warmup_steps=warmup_steps, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop_strings=stop_strings,
            loss_chunk_tokens=loss_chunk_tokens,
        )  # fmt: skip
        if stop_strings and tokenizer is None:
            raise ValueError(
                f"stop_strings={stop_strings!r} need a tokenizer to decode: pass tokenizer="
            )
        self._adamw = AdamWConfig(
            lr=learning_rate,
            betas=cast(tuple[float, float], tuple(betas)),  # a CLI may pass a list
            eps=eps,
            weight_decay=weight_decay,
        )
        self.save_hyperparameters()
        if isinstance(model, PretrainedConfig):
            self.hparams["model"] = model.to_dict()
        elif isinstance(model, os.PathLike):
            self.hparams["model"] = os.fspath(model)
        self._lora = None if lora is None else LoraOptions.from_value(lora)
        self._config, self.checkpoint_dir = resolve_model_config(model)
        self.converted: ConvertedStore | None = (
            converted_store(self.checkpoint_dir) if isinstance(self.checkpoint_dir, Path) else None
        )
        """The converted store the weights are read from (read-only), or None."""
        self.model: PreTrainedModel | None = None
        self._tokenizer: Tokenizer | None = None
        self._generator: LayerMajorGenerator | None = None
        self.kv_cache_tier: Tier | None = None
        """Where ``predict`` keeps the KV cache (a planning strategy sets it); None: device."""
        self.decode_attention_tier: Tier | None = None
        """Where ``predict``'s decode attention runs (a planning strategy sets it; HOST with
        the cache on the host); None: beside the model."""
        self.kv_cache_nvme: tuple[int, str | None] = (0, None)
        """(last blocks whose KV cache ``predict`` homes on NVMe, the directory for it)."""
        self.kv_store: TieredStore | None = None
        """The store whose host tier homes ``predict``'s KV cache on the host beside the
        device's attention (a planning strategy sets it, having sized the store for it);
        None: the cache holds its own buffers."""

    def model_config(self) -> PretrainedConfig:
        """The Hugging Face configuration of the network (available before it is built)."""
        return self._config

    @property
    def loss_chunk_tokens(self) -> int | None:
        """Tokens per chunk of the training loss's head and cross-entropy, or None when the
        loss runs whole (``loss_chunk_tokens=0``): what a planner prices the loss's logits at."""
        chunk = self.hparams.get("loss_chunk_tokens")
        if chunk is None:
            return loss_chunk_tokens(int(self._config.get_text_config().vocab_size))
        return int(chunk) or None

    def adamw_config(self) -> AdamWConfig:
        """The AdamW hyperparameters, for an optimizer that runs outside ``configure_optimizers``."""
        return self._adamw

    def configure_model(self) -> None:
        """Build the network once (later calls do nothing).

        Random initial weights come from a generator seeded with ``seed``,
        without touching the global random state; a checkpoint directory is
        loaded with ``from_pretrained``, a converted store read tensor by tensor
        (in its dtype, as ``from_pretrained`` keeps a checkpoint's), except under a
        strategy that streams weights (``streams_weights``) from a local checkpoint
        (safetensors, a ``pytorch_model.bin`` it memory-maps, or a converted store): then the
        parameters stay on the meta device and the strategy reads them
        (:class:`~bb_lightning.hf.hf_load.HFCheckpoint`). With ``lora`` the base model is
        built, loaded or left on the meta device the same way, then wrapped by ``peft``:
        the adapters get real initial values seeded with ``seed`` (the same with every
        strategy), and a streamed base is read under ``peft``'s names.
        """
        if self.model is not None:
            return
        check_supported(self._config)
        if self._lora is not None:  # the base model (streamed, loaded or random), with adapters
            require_peft()
            if self.checkpoint_dir is not None and self._streams_weights():
                base = empty_model(self._config)  # adapters real, base weights on meta
            elif self.checkpoint_dir is not None:
                base = self._loaded()
            else:
                with _seeded(int(self.hparams["seed"])):
                    base = AutoModelForCausalLM.from_config(self._config)
            with _seeded(int(self.hparams["seed"])):
                self.model = wrap_lora(base, self._lora)
            self.model.train(self.training)
            return
        if self.checkpoint_dir is not None and self._streams_weights():
            # Parameters on the meta device (buffers real, tied ones tied): the strategy reads
            # each parameter from the checkpoint straight into its tier, never the whole model.
            self.model = empty_model(self._config)
        elif self.checkpoint_dir is not None:
            self.model = self._loaded()
        else:
            with _seeded(int(self.hparams["seed"])):
                self.model = AutoModelForCausalLM.from_config(self._config)
        # from_pretrained returns the network in eval mode, and Lightning's fit keeps the
        # modes it finds: without this a loaded checkpoint would train without its dropout
        self.model.train(self.training)

    def _loaded(self) -> PreTrainedModel:
        """The network with the weights of ``checkpoint_dir`` (a checkpoint or converted store)."""
        if self.converted is not None:
            return load_converted(self.converted, self._config)
        assert self.checkpoint_dir is not None
        return AutoModelForCausalLM.from_pretrained(self.checkpoint_dir)

    def _streams_weights(self) -> bool:
        """Whether the attached strategy reads the local checkpoint itself."""
        trainer = self._trainer
        strategy = trainer.strategy if trainer is not None else None
        if not getattr(strategy, "streams_weights", False) or self.checkpoint_dir is None:
            return False
        if self.converted is not None:
            return True
        return SafetensorsCheckpoint.holds_weights(self.checkpoint_dir)

    def _net(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("the model is not built yet: call configure_model() first")
        return self.model

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of the batch (nats per predicted token), the head and
        the loss in chunks of :attr:`loss_chunk_tokens` positions (transformers' loss and
        gradients either way)."""
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        mask = batch.get("attention_mask")
        chunk = self.loss_chunk_tokens
        if chunk is None:
            return self._net()(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        return causal_lm_loss(self._net(), input_ids, mask, labels, chunk)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self(batch)
        self.log(
            "val_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True
        )
        return loss

    def configure_optimizers(self) -> Any:
        """``torch.optim.AdamW`` over all parameters, with linear warm-up per step if asked."""
        cfg = self._adamw
        optimizer = torch.optim.AdamW(
            [p for p in self._net().parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        warmup = int(self.hparams["warmup_steps"])
        if warmup == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(warmup))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def generation_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``generate`` from the decoding hyperparameters."""
        hp = self.hparams
        kwargs: dict[str, Any] = {"max_new_tokens": int(hp["max_new_tokens"])}
        if hp["temperature"] > 0.0:
            kwargs.update(
                do_sample=True,
                temperature=float(hp["temperature"]),
                top_k=int(hp["top_k"]),
                top_p=float(hp["top_p"]),
            )
        else:
            kwargs.update(do_sample=False)
        return kwargs

    def generation_config(self) -> GenerationConfig:
        """Decoding settings for the layer-major generator, from the hyperparameters."""
        net = self._net()
        eos = net.generation_config.eos_token_id
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = net.generation_config.pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        hp = self.hparams
        return GenerationConfig(
            max_new_tokens=int(hp["max_new_tokens"]),
            temperature=float(hp["temperature"]),
            top_k=int(hp["top_k"]),
            top_p=float(hp["top_p"]),
            eos_token_ids=eos_ids,
            pad_token_id=int(pad),
            stop_strings=tuple(hp.get("stop_strings") or ()),
        )

    def prompt_seed(self, prompt_id: str) -> int:
        """Sampling seed of one prompt: a hash of ``seed`` and its id (not of its batch)."""
        return zlib.crc32(f"{int(self.hparams['seed'])}\0{prompt_id}".encode())

    def predict_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> list[dict[str, Any]]:
        """Generate for each prompt; returns ``{"id", "token_ids", "text"?}`` per prompt.

        Runs :class:`~bb_lightning.engine.generate.LayerMajorGenerator` over the whole
        batch (each block once per step). ``token_ids`` are the new tokens, cut before
        the first eos or stop string. Prompts flagged with an ``error`` in the batch, too
        long for the model's context, or longer with their new tokens than the static KV
        cache the model generates right with, are not run and come back as ``{"id", "error"}``.
        """
        net = self._net()
        gen = self._generator
        tiers = (self.kv_cache_tier, self.decode_attention_tier, self.kv_cache_nvme)
        have = None if gen is None else (gen.kv_tier, gen.attention_tier, gen.kv_nvme)
        stale = gen is not None and (gen.model is not net or gen.kv_store is not self.kv_store)
        if gen is None or stale or have != tiers:
            if gen is not None:
                gen.close()
            gen = self._generator = LayerMajorGenerator(
                net, kv_tier=tiers[0], attention_tier=tiers[1], kv_nvme_layers=tiers[2][0],
                kv_nvme_dir=tiers[2][1], kv_store=self.kv_store,
            )  # fmt: skip
        ids: list[str] = list(batch["id"])
        errors: list[str | None] = list(batch.get("error") or [None] * len(ids))
        lengths = batch["attention_mask"].sum(-1).tolist()
        new = self.generation_config().max_new_tokens
        errors = [e or gen.check_prompt(int(n), new) for e, n in zip(errors, lengths, strict=True)]
        keep = [i for i, e in enumerate(errors) if e is None]
        results: dict[int, dict[str, Any]] = {
            i: {"id": ids[i], "error": e} for i, e in enumerate(errors) if e is not None
        }
        if keep:
            rows = torch.tensor(keep, device=batch["input_ids"].device)
            mask = batch["attention_mask"].index_select(0, rows)
            width = int(mask.sum(-1).max())  # drop columns that only pad the skipped rows
            tok = self.tokenizer
            out = gen.generate(
                batch["input_ids"].index_select(0, rows)[:, -width:],
                mask[:, -width:],
                self.generation_config(),
                seeds=[self.prompt_seed(ids[i]) for i in keep],
                decode=None if tok is None else (lambda t: decode_ids(tok, t)),
            )
            for row, g in zip(keep, out, strict=True):
                record: dict[str, Any] = {"id": ids[row], "token_ids": g.token_ids}
                if g.text is not None:
                    record["text"] = g.text
                results[row] = record
        return [results[i] for i in range(len(ids))]

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer used to decode predictions (loaded on first use), or None."""
        name = self.hparams.get("tokenizer")
        if name is None:
            return None
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(name)
        return self._tokenizer
