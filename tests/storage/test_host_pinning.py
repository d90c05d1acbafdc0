"""Which host memory the store page-locks, and on which NUMA node.

CUDA cannot run here, so a stand-in runtime (``torch.cuda.is_available`` True and a
``cudart`` that records ``cudaHostRegister`` calls) plays a machine with a GPU: a store on
the CPU device must not pin there, and a pinned buffer's pages are asked for on the node
it is given before the registration touches them (``/proc/self/numa_maps`` shows it).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from storage.host import HostBuffer
from storage.io import IOConfig
from storage.numa import numa_node, pci_address, prefer_node
from storage.store import StoreConfig, TieredStore

MiB = 1 << 20


class _FakeCudart:
    """Records (de)registrations; every call succeeds."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.policy_at_register: list[str | None] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered.append((ptr, nbytes))
        self.policy_at_register.append(_policy(ptr))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def _policy(address: int) -> str | None:
    """The memory policy ``/proc/self/numa_maps`` gives the mapping at ``address``."""
    try:
        lines = Path("/proc/self/numa_maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        start, policy = line.split()[:2]
        if int(start, 16) == address:
            return policy
    return None


@pytest.fixture
def gpu_visible(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_cpu_store_pins_nothing_where_cuda_is_visible(
    gpu_visible: _FakeCudart, tmp_path: Path
) -> None:
    """StoreConfig(device="cpu") on a machine with a GPU: the host arena and the staging
    buffers stay pageable (no cudaHostRegister), and the store still works."""
    config = StoreConfig(
        device_budget=MiB,
        host_budget=4 * MiB,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=4 * MiB,
        staging_buffers=2,
        staging_bytes=MiB,
        io=IOConfig(backend="posix"),
        device="cpu",
    )
    with TieredStore(config) as store:
        assert gpu_visible.registered == []
        assert not store._host_arena.pinned
        assert store._staging is not None
        assert not any(b.pinned for b in store._staging._buffers)
        assert not store.pins_host and store.host_node is None
    # a buffer asked to pin still pins where CUDA is visible (what a CUDA store asks)
    buf = HostBuffer(64 << 10)
    assert buf.pinned and gpu_visible.registered == [(buf.tensor.data_ptr(), 64 << 10)]
    buf.release()
    assert gpu_visible.unregistered == [gpu_visible.registered[0][0]]


def test_numa_node_of_a_pci_device_from_sysfs(tmp_path: Path) -> None:
    """The GPU's node is read from <sysfs>/<domain:bus:device.function>/numa_node; -1, a
    missing device or an unreadable value give None (no placement)."""
    address = pci_address(0, 0x3B, 0)
    assert address == "0000:3b:00.0"
    (tmp_path / address).mkdir()
    (tmp_path / address / "numa_node").write_text("1\n")
    assert numa_node(address, sysfs=tmp_path) == 1
    assert numa_node("0000:3B:00.0", sysfs=tmp_path) == 1  # nvidia-smi spells it in capitals
    (tmp_path / address / "numa_node").write_text("-1\n")
    assert numa_node(address, sysfs=tmp_path) is None
    (tmp_path / address / "numa_node").write_text("x\n")
    assert numa_node(address, sysfs=tmp_path) is None
    assert numa_node("0000:af:00.0", sysfs=tmp_path) is None


_NUMA_MAPS = pytest.mark.skipif(
    not Path("/proc/self/numa_maps").exists(), reason="no /proc/self/numa_maps (no NUMA kernel)"
)


@_NUMA_MAPS
def test_pinned_pages_are_asked_for_on_the_node_before_registration(
    gpu_visible: _FakeCudart,
) -> None:
    """HostBuffer(pin=True, node=0): when cudaHostRegister touches the pages, the mapping
    already carries the policy 'prefer:0' (the kernel places them there, not on the
    registering thread's node); without a node, the default policy."""
    buf = HostBuffer(256 << 10, node=0)
    assert buf.pinned and buf.node == 0
    assert gpu_visible.policy_at_register == ["prefer:0"]
    buf.release()
    plain = HostBuffer(256 << 10)
    assert plain.node is None and gpu_visible.policy_at_register[-1] == "default"
    plain.release()
    assert prefer_node(4096, 4096, None) is False  # no node: nothing asked


@_NUMA_MAPS
def test_a_node_the_machine_lacks_is_refused_quietly() -> None:
    """A node past the machine's (another machine's sysfs) changes nothing."""
    nodes = [p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*")]
    missing = max((int(n[4:]) for n in nodes), default=0) + 1
    region = mmap.mmap(-1, 4096)
    address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    assert prefer_node(address, 4096, missing) is False
    assert _policy(address) == "default"
