"""Hardware presets: a data table for planning machines one does not have.

Every figure is a datasheet value times a stated realistic efficiency. Units:
bytes for memory and capacity, bytes/s for bandwidths, FLOP/s for compute and
parameter updates per second for the host optimizer. The factors below apply
to all entries unless an entry says otherwise; override any field of a preset
with :meth:`bb_lightning.planner.profile.HardwareProfile.replace`.

Shared assumptions:

- ``device_memory``: datasheet capacity (as reported by ``nvidia-smi``) × 0.90
  usable (the CUDA context, cuBLAS workspaces and allocator fragmentation take
  the rest).
- ``device_flops``: datasheet dense (no 2:4 sparsity) bf16 tensor-core FLOP/s
  × 0.60, the share large bf16 GEMMs sustain in practice.
- ``h2d_bandwidth`` / ``d2h_bandwidth``: PCIe x16 theoretical per direction
  (Gen3 15.75 GB/s, Gen4 31.5 GB/s, Gen5 63.0 GB/s) × 0.80 for pinned copies.
- ``device_memory_bandwidth``: datasheet memory bandwidth × 0.80, the share a
  streaming read sustains.
- ``host_memory``: a typical host for one such GPU, × 0.80 usable.
- NVMe: one drive of the stated class, datasheet sequential figures × 0.85.
- ``host_memory_bandwidth``: the bytes/s one process reads host memory at with
  all its cores: a server socket with 8 DDR4-3200 channels (204.8 GB/s
  theoretical × 0.5 sustained by one process ≈ 102 GB/s), a dual-channel
  DDR5-5600 desktop (89.6 GB/s × 0.6 ≈ 54 GB/s), a cloud VM with a slice of a
  socket (≈ 60 GB/s). Decode attention over a KV cache on the host reads the
  cache at this rate.
- ``host_adam_params_per_s``: a fused AdamW update reads parameter, gradient
  and two moments and writes parameter and two moments, 7 × 4 = 28 bytes of
  fp32 per parameter, so it is bound by memory bandwidth: sustained host
  bandwidth / 28 bytes: ≈ 3.6e9 updates/s on the server socket, ≈ 1.9e9 on the
  desktop, ≈ 2.1e9 on the cloud VM.
- ``intra_node_bandwidth``: what one GPU sends another of its node per direction in
  a ring collective (NCCL): NVLink where the datasheet gives it (its total
  bidirectional figure / 2), else PCIe x16 per direction (peer-to-peer, or staged
  through host memory where the driver has no peer access), × 0.80: the bus
  bandwidth NCCL's all-gather and reduce-scatter sustain at large messages.
- ``inter_node_bandwidth``: one GPU's share of the node's network, per direction:
  the typical node's adapters / its GPUs (a DGX has one adapter per GPU), × 0.80.

A row is one GPU with its share of a typical node (the datacenter rows' host memory is
a DGX's 2 TB / 8 GPUs, and a DGX has a data NVMe drive per GPU): the node of ``gpus``
such GPUs (:func:`preset_fields`, ``bb-lightning plan --devices G``) has ``gpus`` times
the host memory and the NVMe capacity and bandwidths. Its cores, host AdamW rate and host
memory bandwidth (the node's sockets) stay the row's.
"""

from __future__ import annotations

import re
from typing import Any

GIB = 1024**3
GB = 1e9
TB = 1e12

_MEM_USABLE = 0.90
_FLOPS_EFF = 0.60
_PCIE_EFF = 0.80
_HOST_USABLE = 0.80
_NVME_EFF = 0.85
_HBM_EFF = 0.80
_LINK_EFF = 0.80  # NCCL bus bandwidth / link rate at large messages

_PCIE_GEN3 = 15.75 * GB  # bytes/s per direction, x16
_PCIE_GEN4 = 31.5 * GB
_PCIE_GEN5 = 63.0 * GB

_NVLINK3 = 600 * GB / 2  # bytes/s per direction: A100 SXM datasheet "NVLink 600 GB/s"
_NVLINK4 = 900 * GB / 2  # bytes/s per direction: H100/H200 SXM datasheet "NVLink 900 GB/s"
_IB_HDR = 200e9 / 8  # bytes/s: one 200 Gb/s HDR InfiniBand adapter (DGX A100: one per GPU)
_IB_NDR = 400e9 / 8  # bytes/s: one 400 Gb/s NDR adapter (DGX H100/H200: one per GPU)
_ETH_25G = 25e9 / 8  # bytes/s: a cloud instance with one GPU (AWS g4dn, g6: up to 25 Gb/s)
_ETH_10G = 10e9 / 8  # bytes/s: a workstation's 10 Gb Ethernet port

_HOST_BW_SERVER = 204.8 * GB * 0.5  # bytes/s, 8 x DDR4-3200 socket
_HOST_BW_DESKTOP = 89.6 * GB * 0.6  # bytes/s, 2 x DDR5-5600
_HOST_BW_CLOUD_VM = 60.0 * GB  # bytes/s, part of a socket

_ADAM_SERVER = _HOST_BW_SERVER / 28  # updates/s
_ADAM_DESKTOP = _HOST_BW_DESKTOP / 28  # updates/s
_ADAM_CLOUD_VM = _HOST_BW_CLOUD_VM / 28  # updates/s

# Datacenter PCIe 4 NVMe (e.g. Samsung PM9A3 3.84 TB class): 6.5 GB/s read, 3.5 GB/s write.
_NVME_DC_GEN4 = {"read": 6.5 * GB, "write": 3.5 * GB, "capacity": 3.84 * TB}
# Datacenter PCIe 5 NVMe (e.g. Micron 9550 class): 14 GB/s read, 7 GB/s write (mixed-size writes).
_NVME_DC_GEN5 = {"read": 14.0 * GB, "write": 7.0 * GB, "capacity": 7.68 * TB}
# Consumer PCIe 4 NVMe (e.g. Samsung 990 Pro 2 TB): 7.45 GB/s read; writes past the SLC
# cache sustain about 2 GB/s, the figure that matters for multi-GB write-back.
_NVME_CONSUMER_GEN4 = {"read": 7.45 * GB, "write": 2.0 * GB, "capacity": 2.0 * TB}
# The ZeRO-Inference A6000 machine's one PCIe 4 NVMe at 5.6 GB/s read; writes and capacity
# as the datacenter Gen4 class above.
_NVME_A6000_HOST = {"read": 5.6 * GB, "write": 3.5 * GB, "capacity": 3.84 * TB}

PRESETS: dict[str, dict[str, Any]] = {
    "a100-40gb": {
        "name": "A100-40GB SXM (preset)",
        "bandwidth": 1555 * GB,  # datasheet HBM2, bytes/s
        "memory": 40 * GIB,  # datasheet 40 GB HBM2 (nvidia-smi: 40960 MiB)
        "flops": 312e12,  # datasheet dense bf16 tensor core
        "pcie": _PCIE_GEN4,
        "host": 256 * GIB,  # typical: 2 TB DGX A100 / 8 GPUs
        "nvme": _NVME_DC_GEN4,
        "adam": _ADAM_SERVER,
        "host_bw": _HOST_BW_SERVER,
        "cores": 32,
        "peer": _NVLINK3,
        "network": _IB_HDR,
    },
    "a100-80gb": {
        "name": "A100-80GB SXM (preset)",
        "bandwidth": 2039 * GB,  # datasheet HBM2e, bytes/s
        "memory": 80 * GIB,  # datasheet 80 GB HBM2e (nvidia-smi: 81920 MiB)
        "flops": 312e12,  # datasheet dense bf16 tensor core
        "pcie": _PCIE_GEN4,
        "host": 256 * GIB,  # typical: 2 TB DGX A100 / 8 GPUs
        "nvme": _NVME_DC_GEN4,
        "adam": _ADAM_SERVER,
        "host_bw": _HOST_BW_SERVER,
        "cores": 32,
        "peer": _NVLINK3,
        "network": _IB_HDR,
    },
    "h100": {
        "name": "H100 SXM 80GB (preset)",
        "bandwidth": 3.35 * TB,  # datasheet HBM3, bytes/s
        "memory": 80 * GIB,  # datasheet 80 GB HBM3 (nvidia-smi: 81559 MiB)
        "flops": 989e12,  # datasheet dense bf16 tensor core (1979 with sparsity)
        "pcie": _PCIE_GEN5,
        "host": 256 * GIB,  # typical: 2 TB DGX H100 / 8 GPUs
        "nvme": _NVME_DC_GEN5,
        "adam": _ADAM_SERVER,
        "host_bw": _HOST_BW_SERVER,
        "cores": 56,  # typical: 2 x 56-core Xeon 8480C / 2 sockets
        "peer": _NVLINK4,
        "network": _IB_NDR,
    },
    "h200": {
        "name": "H200 SXM 141GB (preset)",
        "bandwidth": 4.8 * TB,  # datasheet HBM3e, bytes/s
        "memory": 141 * GB,  # datasheet 141 GB HBM3e (nvidia-smi: 143771 MiB)
        "flops": 989e12,  # datasheet dense bf16 tensor core, same GH100 compute as H100
        "pcie": _PCIE_GEN5,
        "host": 256 * GIB,  # typical: 2 TB DGX H200 / 8 GPUs
        "nvme": _NVME_DC_GEN5,
        "adam": _ADAM_SERVER,
        "host_bw": _HOST_BW_SERVER,
        "cores": 56,
        "peer": _NVLINK4,
        "network": _IB_NDR,
    },
    "rtx4090": {
        "name": "GeForce RTX 4090 24GB (preset)",
        "bandwidth": 1008 * GB,  # datasheet GDDR6X, bytes/s
        "memory": 24 * GIB,  # datasheet 24 GB GDDR6X (nvidia-smi: 24564 MiB)
        "flops": 165.2e12,  # Ada whitepaper: dense bf16 tensor, fp32 accumulate
        "pcie": _PCIE_GEN4,
        "host": 64 * GIB,  # typical workstation
        "nvme": _NVME_CONSUMER_GEN4,
        "adam": _ADAM_DESKTOP,
        "host_bw": _HOST_BW_DESKTOP,
        "cores": 16,
        "peer": _PCIE_GEN4,  # no NVLink, no peer access: staged through host memory over PCIe
        "network": _ETH_10G,
    },
    "l4": {
        "name": "L4 24GB (preset)",
        "bandwidth": 300 * GB,  # datasheet GDDR6, bytes/s
        "memory": 24 * GB,  # datasheet 24 GB GDDR6 (nvidia-smi: 23034 MiB)
        # datasheet 242 TFLOP/s bf16 is with sparsity: dense 121; the 72 W power cap
        # holds large GEMMs lower, so the efficiency is 0.50 instead of 0.60.
        "flops": 121e12,
        "flops_eff": 0.50,
        "pcie": _PCIE_GEN4,
        "host": 128 * GIB,  # typical cloud instance with one L4 (e.g. 32 vCPU)
        "nvme": _NVME_DC_GEN4,
        "adam": _ADAM_CLOUD_VM,
        "host_bw": _HOST_BW_CLOUD_VM,
        "cores": 16,
        "peer": _PCIE_GEN4,  # no NVLink: PCIe peer-to-peer
        "network": _ETH_25G,
    },
    "t4": {
        "name": "T4 16GB (preset)",
        "bandwidth": 320 * GB,  # datasheet GDDR6, bytes/s
        "memory": 16 * GB,  # datasheet 16 GB GDDR6 (nvidia-smi: 15360 MiB)
        # Turing has no bf16: this is the datasheet fp16 tensor figure (65 TFLOP/s), with
        # efficiency 0.50 for the 70 W power cap. bf16 models run in fp16 on it.
        "flops": 65e12,
        "flops_eff": 0.50,
        "pcie": _PCIE_GEN3,
        "host": 64 * GIB,  # typical cloud instance with one T4 (e.g. 16 vCPU)
        "nvme": _NVME_DC_GEN4,
        "adam": _ADAM_CLOUD_VM,
        "host_bw": _HOST_BW_CLOUD_VM,
        "cores": 8,
        "peer": _PCIE_GEN3,  # no NVLink: PCIe peer-to-peer
        "network": _ETH_25G,
    },
    "a6000": {
        "name": "RTX A6000 48GB (preset)",
        "bandwidth": 768 * GB,  # NVIDIA RTX A6000 datasheet: 48 GB GDDR6, 768 GB/s
        "memory": 48 * GIB,  # NVIDIA RTX A6000 datasheet: 48 GB GDDR6 (nvidia-smi: 49140 MiB)
        # NVIDIA RTX A6000 datasheet: 309.7 TFLOP/s tensor performance with 2:4 sparsity, so
        # 154.8 dense; the Ampere GA102 whitepaper gives the same for fp16 and bf16 with fp32
        # accumulate on this (professional) card.
        "flops": 154.8e12,
        "pcie": _PCIE_GEN4,
        "host": 252 * GB,  # the ZeRO-Inference A6000 machine: 252 GB of DRAM
        "nvme": _NVME_A6000_HOST,
        "adam": _ADAM_SERVER,
        "host_bw": _HOST_BW_SERVER,
        "cores": 32,  # typical workstation or server socket beside one A6000
        "peer": _PCIE_GEN4,  # PCIe peer-to-peer (the NVLink bridge joins pairs only)
        "network": _ETH_10G,
    },
}


def preset_fields(key: str, gpus: int = 1) -> dict[str, Any]:
    """Turn one table row into ``HardwareProfile`` keyword arguments (units as there): a
    node of ``gpus`` such GPUs, with ``gpus`` times the row's host memory, NVMe capacity
    and NVMe bandwidths (see the module docstring)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus = {gpus!r} GPUs per node: give a positive integer (1: one GPU)")
    row = PRESETS[key]
    nvme = {k: v * gpus for k, v in row["nvme"].items()}
    name = row["name"] if gpus == 1 else f"{row['name']}, node of {gpus}"
    return {
        "name": name,
        "device_type": "cuda",
        "device_memory": int(row["memory"] * _MEM_USABLE),
        "device_flops": float(row["flops"] * row.get("flops_eff", _FLOPS_EFF)),
        "peak_flops": float(row["flops"]),
        "h2d_bandwidth": float(row["pcie"] * _PCIE_EFF),
        "d2h_bandwidth": float(row["pcie"] * _PCIE_EFF),
        "host_memory": int(row["host"] * gpus * _HOST_USABLE),
        "nvme_read_bandwidth": float(nvme["read"] * _NVME_EFF),
        "nvme_write_bandwidth": float(nvme["write"] * _NVME_EFF),
        "nvme_capacity": int(nvme["capacity"]),
        "host_adam_params_per_s": float(row["adam"]),
        "cores": int(row["cores"]),
        "device_memory_bandwidth": float(row["bandwidth"] * _HBM_EFF),
        "host_memory_bandwidth": float(row["host_bw"]),
        "intra_node_bandwidth": float(row["peer"] * _LINK_EFF),
        "inter_node_bandwidth": float(row["network"] * _LINK_EFF),
    }


DATASHEET_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("A6000", 154.8e12),  # NVIDIA RTX A6000 datasheet: 309.7 with 2:4 sparsity
    ("L40S", 362e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),
    ("T4", 65e12),  # fp16: Turing has no bf16
)
"""Dense (no 2:4 sparsity) bf16 tensor-core FLOP/s of the vendor data sheets, by the
product name in the CUDA device name (``torch.cuda.get_device_name``)."""


def datasheet_flops(device_name: str) -> float:
    """The datasheet dense bf16 FLOP/s of the GPU called ``device_name`` (e.g. ``"NVIDIA
    H100 80GB HBM3"``), 0.0 when it is not in :data:`DATASHEET_FLOPS`. A product name
    matches as a whole word (``A10`` is not ``A100``, ``L4`` not ``L40S``)."""
    for product, flops in DATASHEET_FLOPS:
        if re.search(rf"(?<![0-9A-Za-z]){re.escape(product)}(?![0-9A-Za-z])", device_name):
            return flops
    return 0.0
