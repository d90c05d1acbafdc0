"""One run of the balance_beam strategy at ``--devices`` ranks, as a user script, for the
data-parallel tests: ``python dp_run.py --devices 2 --accum 2 --model DIR --out DIR``.

With ``--devices`` > 1 Lightning's popen launcher starts this script again for every
other rank (with ``LOCAL_RANK`` set), so everything happens inside :func:`main`, the
same on every rank. The data are 48 fixed rows of random tokens; the sampler strides
one seeded permutation in micro-batches, so that micro-batch ``j`` of optimizer step
``k`` holds the same rows whatever the world size: step ``k`` covers rows
``[k * G, (k + 1) * G)`` of the permutation (G the global batch), rank ``r`` takes
its micro-batches ``r, r + N, ...``. An epoch is two optimizer steps, so a checkpoint
written at the end of step 2 ends an epoch.

What it writes under ``--out``:

- ``losses.rank<r>.json``: ``[[rank, step, loss], ...]``, one per micro-batch (loss in
  nats per token, not divided by the accumulation);
- ``seen.rank<r>.json`` (predict): the prompt ids this rank generated;
- ``ckpt/`` (fit; or ``--ckpt``): the checkpoint, saved by every rank with
  ``trainer.save_checkpoint`` after fit; ``mid.ckpt`` (``--save-at k``): the one
  ``ModelCheckpoint`` saved at the end of step ``k``, the kind a run resumes from;
- ``state.pt`` and ``result.json`` (rank 0, fit): the masters and AdamW moments read
  back from ``ckpt/state.zarr`` with plain zarr; the step count and the world size that
  saved it from ``meta.json``, and the run's world size. With ``--plain`` (plain
  Lightning, no checkpoint: one process, or Lightning's own DDP at ``--devices`` > 1):
  the trained parameters and ``torch.optim.AdamW``'s moments.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import zarr
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.data import PromptsDataModule
from bb_lightning.data.writer import JsonlPredictionWriter
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

ROWS = 48
SEQ = 32
VOCAB = 256
STEPS_PER_EPOCH = 2
DATA_SEED = 7
PERTURBED = "model.model.layers.1.mlp.up_proj.weight"
"""The weight ``--perturb`` changes on rank 1 (in block 1, ``model.layers.1`` of the network)."""
EMBED = "model.model.embed_tokens.weight"
"""The embedding, frozen by ``--freeze-embed``."""


class StridedSteps(DistributedSampler[Any]):
    """Rank ``rank``'s rows of one seeded permutation, in micro-batches of ``micro``.

    Epoch ``e`` is the window of ``rows_per_epoch`` rows from ``e * rows_per_epoch`` of
    the permutation (wrapping around), cut into micro-batches; rank ``r`` of ``N`` takes
    micro-batches ``r, r + N, ...``. A :class:`DistributedSampler`, so Lightning keeps it.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int,
        rank: int,
        micro: int,
        rows_per_epoch: int,
        seed: int,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)
        if rows_per_epoch % (micro * num_replicas):
            raise ValueError(
                f"rows_per_epoch={rows_per_epoch} is not a multiple of micro={micro} x "
                f"num_replicas={num_replicas}"
            )
        self.micro = micro
        self.rows_per_epoch = rows_per_epoch
        self.num_samples = rows_per_epoch // num_replicas
        self.total_size = rows_per_epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        start = self.epoch * self.rows_per_epoch
        window = [perm[(start + i) % n] for i in range(self.rows_per_epoch)]
        chunks = [window[i : i + self.micro] for i in range(0, len(window), self.micro)]
        return iter([row for chunk in chunks[self.rank :: self.num_replicas] for row in chunk])

    def __len__(self) -> int:
        return self.num_samples


class _Rows(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(DATA_SEED)
        self.rows = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


class RowsData(pl.LightningDataModule):
    """The 48 rows, in micro-batches of ``micro``, ``global_batch`` rows per optimizer step.

    ``loader``: ``"strided"`` (:class:`StridedSteps`, the same rows per step at any world
    size), ``"plain"`` (a plain ``DataLoader``: Lightning gives each rank its
    ``DistributedSampler``), ``"user"`` (a seeded ``RandomSampler`` of the user's, which
    Lightning wraps in its ``DistributedSamplerWrapper``)."""

    def __init__(self, micro: int, global_batch: int, loader: str = "strided") -> None:
        super().__init__()
        self.micro = micro
        self.global_batch = global_batch
        self.loader = loader

    def train_dataloader(self) -> DataLoader[Any]:
        trainer = self.trainer
        assert trainer is not None
        data = _Rows()
        if self.loader == "plain":
            return DataLoader(data, batch_size=self.micro)
        if self.loader == "user":
            gen = torch.Generator().manual_seed(DATA_SEED)
            return DataLoader(
                data, batch_size=self.micro, sampler=RandomSampler(data, generator=gen)
            )
        sampler = StridedSteps(
            data,
            num_replicas=trainer.world_size,
            rank=trainer.global_rank,
            micro=self.micro,
            rows_per_epoch=STEPS_PER_EPOCH * self.global_batch,
            seed=DATA_SEED,
        )
        return DataLoader(data, batch_size=self.micro, sampler=sampler)


class RecordingModule(CausalLMModule):
    """The project's module, recording each micro-batch's loss and each predicted id;
    with ``perturb``, rank 1 adds 0.01 to one weight of the built network."""

    def __init__(
        self,
        *args: Any,
        perturb: bool = False,
        raise_at: int | None = None,
        freeze_embed: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.perturb = perturb
        self.raise_at = raise_at
        self.freeze_embed = freeze_embed
        self.losses: list[tuple[int, int, float]] = []
        self.seen: list[str] = []

    def configure_model(self) -> None:
        built = self.model is not None
        super().configure_model()
        if self.freeze_embed and not built:
            self.get_parameter(EMBED).requires_grad_(False)
        if self.perturb and not built and self.trainer.global_rank == 1:
            with torch.no_grad():
                self.get_parameter(PERTURBED).add_(0.01)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        if self.raise_at == trainer.global_step and trainer.global_rank == 1:
            raise RuntimeError(f"the user's training_step fails at step {self.raise_at}")
        loss = super().training_step(batch, batch_idx)
        self.losses.append((trainer.global_rank, trainer.global_step, float(loss.detach())))
        return loss

    def predict_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> list[dict[str, Any]]:
        self.seen += [str(i) for i in batch["id"]]
        return super().predict_step(batch, batch_idx, dataloader_idx)


class UserModule(pl.LightningModule):
    """A LightningModule as a user writes one: a Hugging Face model loaded from its
    ``save_pretrained`` directory in ``__init__``, its own ``training_step``, AdamW; it
    records each micro-batch's loss as :class:`RecordingModule` does."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.losses: list[tuple[int, int, float]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        loss = self.net(input_ids=ids, labels=ids).loss
        trainer = self.trainer
        self.losses.append((trainer.global_rank, trainer.global_step, float(loss.detach())))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss, batch_size=ids.shape[0], sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per rank per step")
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="max_steps")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    p.add_argument("--tier", choices=["host", "nvme"], default="host")
    p.add_argument("--nvme-path", default=None, help="the strategy's nvme_path")
    p.add_argument("--model", required=True, help="a save_pretrained directory")
    p.add_argument("--from-config", action="store_true", help="random weights of its config")
    p.add_argument("--plain", action="store_true", help="plain Lightning (one process)")
    p.add_argument("--perturb", action="store_true", help="rank 1 changes one initial weight")
    p.add_argument("--save-at", type=int, default=None, help="ModelCheckpoint at this step")
    p.add_argument("--resume", default=None, help="ckpt_path of trainer.fit")
    p.add_argument("--predict", default=None, help="a prompts .jsonl: predict instead of fit")
    p.add_argument("--predictions", default=None, help="the JSONL writer's output file")
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None, help="where to save the checkpoint (default out/ckpt)")
    p.add_argument("--chdir", default=None, help="after fit, rank r works in <chdir>/rank<r>")
    p.add_argument("--raise-at", type=int, default=None, help="rank 1 fails at this step")
    p.add_argument("--validate", action="store_true", help="trainer.validate after fit")
    p.add_argument(
        "--save-pretrained", action="store_true", help="weights left in the store after fit, "
        "then save_pretrained(out/hf) on every rank"
    )  # fmt: skip
    p.add_argument("--freeze-embed", action="store_true", help="the embedding trains not")
    p.add_argument("--user-module", action="store_true", help="UserModule, not the project's")
    p.add_argument("--loader", choices=["strided", "plain", "user"], default="strided",
                   help="the training rows' sampler (RowsData)")  # fmt: skip
    p.add_argument("--lora", type=int, default=None, help="train LoRA adapters of this rank")
    p.add_argument("--pg-timeout", type=float, default=None, help="collectives' timeout (s)")
    return p.parse_args(argv)


def read_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Masters and moments by kind and parameter name, from ``path/state.zarr`` with plain
    zarr, and ``path/meta.json`` (the step count, the world size that saved it)."""
    group = zarr.open_group(str(path / "state.zarr"), mode="r")
    state: dict[str, dict[str, torch.Tensor]] = {}
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        sub = group[kind]
        assert isinstance(sub, zarr.Group)
        state[kind] = {name: torch.from_numpy(a[...]) for name, a in sub.arrays()}
    return state, json.loads((path / "meta.json").read_text())


def callbacks(args: argparse.Namespace, out: Path) -> list[pl.Callback]:
    """The prediction writer (predict), a ``ModelCheckpoint`` saving ``out/mid.ckpt`` at
    step ``--save-at`` (fit)."""
    if args.predict:
        return [JsonlPredictionWriter(args.predictions)]
    if args.save_at is None:
        return []
    return [ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=args.save_at)]


def write_plain_state(trainer: pl.Trainer, module: pl.LightningModule, out: Path) -> None:
    """``state.pt`` and ``result.json`` of a plain Lightning run (one process, or Lightning's
    DDP on several ranks: rank 0 writes): the trained parameters and
    ``torch.optim.AdamW``'s moments, named as in the module."""
    adam = trainer.optimizers[0].state
    state: dict[str, dict[str, torch.Tensor]] = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, param in module.named_parameters():
        if not param.requires_grad:  # a LoRA base: no optimizer state, not in a checkpoint
            continue
        state["master"][name] = param.detach().clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            state[kind][name] = adam[param][kind].clone()
    if not trainer.is_global_zero:  # DDP: every rank holds the same
        return
    torch.save(state, out / "state.pt")
    result = {"step": trainer.global_step, "world_size": trainer.world_size, "saved_by": None}
    (out / "result.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tier = Tier.NVME if args.tier == "nvme" else Tier.HOST
    layers = AutoConfig.from_pretrained(args.model).num_hidden_layers
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(layers, weights=tier, master=tier),
        compute_dtype="fp32",
        nvme_path=args.nvme_path,
        gather_on_teardown=False if args.save_pretrained else None,
        **({} if args.pg_timeout is None else {"timeout": timedelta(seconds=args.pg_timeout)}),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=("ddp" if args.devices > 1 else "auto") if args.plain else strategy,
        precision="32-true",
        max_steps=args.steps,
        accumulate_grad_batches=args.accum,
        gradient_clip_val=args.clip,
        logger=False,
        enable_checkpointing=args.save_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks(args, out),
    )
    model: Any = AutoConfig.from_pretrained(args.model) if args.from_config else args.model
    module: Any = (
        UserModule(args.model)
        if args.user_module
        else RecordingModule(
            model,
            learning_rate=1e-3,
            weight_decay=0.1,
            max_new_tokens=5,
            perturb=args.perturb,
            raise_at=args.raise_at,
            freeze_embed=args.freeze_embed,
            lora=None if args.lora is None else {"rank": args.lora},
        )
    )
    if args.predict:
        data = PromptsDataModule(args.predict, batch_size=2, max_prompt_len=64)
        trainer.predict(module, datamodule=data, return_predictions=False)
        (out / f"seen.rank{trainer.global_rank}.json").write_text(json.dumps(module.seen))
        strategy.close()
        return
    global_batch = args.devices * args.accum * args.micro
    data = RowsData(args.micro, global_batch, args.loader)
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    rank = trainer.global_rank
    (out / f"losses.rank{rank}.json").write_text(json.dumps(module.losses))
    if args.plain:
        write_plain_state(trainer, module, out)
        validate(args, trainer, module, out)
        return  # the unused strategy opened nothing
    if args.chdir is not None:  # a path through /proc/self/cwd then differs between ranks
        os.chdir(Path(args.chdir) / f"rank{rank}")
    ckpt = out / "ckpt" if args.ckpt is None else Path(args.ckpt)
    trainer.save_checkpoint(ckpt)
    if trainer.is_global_zero:
        state, meta = read_checkpoint(ckpt)
        torch.save(state, out / "state.pt")
        result = {"step": meta["step"], "world_size": trainer.world_size}
        result["saved_by"] = meta["world_size"]
        (out / "result.json").write_text(json.dumps(result))
    validate(args, trainer, module, out)
    save_pretrained(args, trainer, module, out)
    strategy.close()


def save_pretrained(args: argparse.Namespace, trainer: pl.Trainer, module: Any, out: Path) -> None:
    """With ``--save-pretrained``: every rank calls the network's ``save_pretrained(out/hf,
    is_main_process=...)`` (the weights are still in the store) and writes what it raised,
    if anything, to ``saved.rank<r>.json``."""
    if not args.save_pretrained:
        return
    error = ""
    try:
        module.model.save_pretrained(out / "hf", is_main_process=trainer.is_global_zero)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    (out / f"saved.rank{trainer.global_rank}.json").write_text(json.dumps({"error": error}))


def validate(args: argparse.Namespace, trainer: pl.Trainer, module: Any, out: Path) -> None:
    """With ``--validate``: ``trainer.validate`` on the 48 rows (Lightning shares them out
    among the ranks) after fit; each rank writes the metrics it got, ``val.rank<r>.json``."""
    if not args.validate:
        return
    metrics = trainer.validate(module, dataloaders=DataLoader(_Rows(), batch_size=4), verbose=False)
    (out / f"val.rank{trainer.global_rank}.json").write_text(json.dumps(metrics[0]))


def record_group_at_exit(out: Path) -> None:
    """At this process's exit, after every exit handler registered later (the strategy's
    among them), write ``exit.<pid>.json``: whether the process group is still there."""

    def record() -> None:
        alive = dist.is_available() and dist.is_initialized()
        (out / f"exit.{os.getpid()}.json").write_text(json.dumps({"group_alive": alive}))

    atexit.register(record)


if __name__ == "__main__":
    record_group_at_exit(Path(parse(sys.argv[1:]).out))
    main(sys.argv[1:])
