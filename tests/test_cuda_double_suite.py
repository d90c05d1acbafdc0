"""Key store tests, fit-equivalence tests (one piece, and in row chunks with the boundary
inputs on each tier) and one greedy-generate-equivalence test, run
again with ``--cuda-double`` (every store under the CPU double of CUDA's copy semantics).

The whole suite runs the same way with ``pytest --cuda-double``; this file keeps a
representative part of it under the double in every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage.deferred import DOUBLE_ENV

ROOT = Path(__file__).resolve().parent.parent
UNDER_THE_DOUBLE = [
    "tests/storage/test_store.py",
    "tests/bb_lightning/strategy/test_strategy.py::test_llama_equals_plain_lightning[device]",
    "tests/bb_lightning/engine/test_generate.py::test_paged_greedy_equals_generate_each_block_once_per_step[device]",
    "tests/bb_lightning/test_chunked_fit.py::test_a_dense_model_fits_in_row_chunks_like_plain_lightning",
]


@pytest.mark.slow
def test_key_tests_pass_under_the_cuda_double() -> None:
    env = dict(os.environ, **{DOUBLE_ENV: "0"})  # the option, not the environment, turns it on
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cuda-double"]
    done = subprocess.run(
        [*cmd, *UNDER_THE_DOUBLE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
