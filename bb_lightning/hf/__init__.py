"""Hugging Face models and checkpoints as users bring them, and as they take them home.

:mod:`~bb_lightning.hf.hf_load` streams a ``save_pretrained`` directory's parameters
through transformers' own key mapping (reading safetensors files with
:mod:`~bb_lightning.hf.safetensors_file`); :mod:`~bb_lightning.hf.convert` writes a model
as a zarr store and :mod:`~bb_lightning.hf.converted` serves one;
:mod:`~bb_lightning.hf.lora` wraps a model in PEFT adapters;
:mod:`~bb_lightning.hf.export` writes trained weights back as a Hugging Face directory.
Nothing here imports Lightning or the strategy's glue.
"""
