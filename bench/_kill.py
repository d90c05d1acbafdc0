"""Shared pieces of the kill campaigns (``faults.py``, ``faults_predict.py``): the tiny model
and the processes.

The parent process only forks: every torch, zarr or Lightning call runs in a child, so
no thread or OpenMP pool of the parent is copied into a child half alive.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LAYERS = 2
VOCAB = 264  # the byte tokenizer's 259 ids, padded to a multiple of 8


def tiny_config() -> dict[str, Any]:
    """The benchmark's model: a 2-layer Llama, hidden 64, vocab 264."""
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }


LOG: list[Path] = []
"""Where children write their output (one file, appended; printed when a run fails)."""


def in_child(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run ``fn(*args, **kwargs)`` in a forked child; its wait status (returns or raises)."""
    pid = os.fork()
    if pid == 0:
        if LOG:
            fd = os.open(LOG[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        code = 0
        try:
            fn(*args, **kwargs)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitpid(pid, 0)[1]


def checked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` in a child; raise when it failed."""
    status = in_child(fn, *args, **kwargs)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        failed()
        raise SystemExit(f"{fn.__name__} failed (wait status {status})")


def failed() -> None:
    """Print the end of the children's output (a run failed)."""
    if LOG and LOG[0].exists():
        print(LOG[0].read_text()[-6000:], file=sys.stderr)


def die() -> None:
    """SIGKILL this process (nothing runs after it: no handler, no flush, no atexit)."""
    os.kill(os.getpid(), signal.SIGKILL)


def make_model(root: Path) -> None:
    """The tiny model, seeded, written with ``save_pretrained`` to ``root/model``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**tiny_config())
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
