"""keep_host_allocations: large host tensors reuse heap memory instead of faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bb_lightning.engine.inference import keep_host_allocations

_PROBE = """
import resource, torch
from bb_lightning.engine.inference import keep_host_allocations

def faults():
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults()
print(plain, keep_host_allocations(1 << 30), faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_activations_are_reused_without_page_faults() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    plain, accepted, kept = done.stdout.split()
    pages = 8 * (64 << 20) // 4096  # what eight fresh 64 MiB mappings fault in (4 KiB pages)
    assert accepted == "True", "glibc takes both mallopt settings"
    assert int(plain) > pages // 2, f"{plain} faults: the default allocator should map afresh"
    assert int(kept) < pages // 4, f"{kept} page faults: freed heap memory should be reused"


@pytest.mark.parametrize("bad", [0, 1 << 19, 1 << 31])
def test_rejects_sizes_outside_the_range(bad: int) -> None:
    with pytest.raises(ValueError, match=f"max_bytes={bad}"):
        keep_host_allocations(bad)
