"""GPUs and links: dense peak TFLOP/s per precision (MFU in observe.py, the step-time bound of `plan`), and for
`plan` the memory and bandwidths it assumes. One table, looked up by the name torch reports or a short name.

Imports no torch (`plan` runs without it); Lightning's fallback table is read only when a GPU is missing here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..precision import table_column


@dataclass(frozen=True)
class Gpu:
    """One accelerator model: dense peaks; memory and NVLink bandwidth where `plan` knows them."""

    peaks: Mapping[str, float]  # TFLOP/s per column: bf16, fp16, tf32, fp32
    memory_mib: int | None = None  # the device total the driver reports (nvidia-smi / rocm-smi)
    intra_node_gb_s: float | None = None  # to its peers, one direction: NVLink / Infinity Fabric, or PCIe


# Dense peak tensor TFLOP/s of one GPU, from NVIDIA's datasheets and architecture whitepapers, which
# quote tensor figures "with sparsity" (2:4 structured sparsity, twice the dense rate a training run
# can reach): the dense figure is half of that. fp32 is the non-tensor rate; tf32 applies to 32-true
# when torch.backends.cuda.matmul.allow_tf32 is on. bf16/fp16 are with fp32 accumulation (what
# PyTorch uses; GeForce cards run fp16 accumulation twice as fast). A GPU missing here falls back to
# Lightning's table (LIGHTNING_ROWS_NOT_USED says which of its rows are wrong and skipped). Cards
# without NVLink reach their peers over PCIe Gen4 x16 (32 GB/s one way).
HOPPER = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}
HOPPER_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}
HOPPER_PCIE = {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}
AMPERE = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
A10 = {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}
GPUS: dict[str, Gpu] = {
    "GB200": Gpu({"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0}),  # GB200 NVL72: 360 PF sparse bf16 / 72 GPUs / 2
    "B200": Gpu({"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}, 183359, 900.0),
    "GH200": Gpu(HOPPER),
    "H200 SXM": Gpu(HOPPER, 143771, 450.0),
    "H200 NVL": Gpu(HOPPER_NVL),
    "H100 SXM": Gpu(HOPPER, 81559, 450.0),
    "H100 NVL": Gpu(HOPPER_NVL),
    "H100 PCIe": Gpu(HOPPER_PCIE),
    # The export variants: H800 computes as the H100 (less NVLink bandwidth); H20 is a cut-down Hopper.
    "H800 SXM": Gpu(HOPPER),
    "H800 PCIe": Gpu(HOPPER_PCIE),
    "H20": Gpu({"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    "A100 40GB": Gpu(AMPERE, 40960, 300.0),
    "A100": Gpu(AMPERE, 81920, 300.0),  # the 80 GB model
    "L40S": Gpu({"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}, 46068, 32.0),
    "L40": Gpu({"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    "L4": Gpu({"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}, 23034, 32.0),
    "A40": Gpu({"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    "A10": Gpu(A10, 23028, 32.0),
    # AWS's A10G has no NVIDIA datasheet; like Lightning, the A10's figures (set logger.peak_tflops to override).
    "A10G": Gpu(A10),
    "RTX A6000": Gpu({"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    # Ada whitepaper, fp32 accumulate
    "RTX 4090": Gpu({"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}, 24564, 32.0),
    "T4": Gpu({"fp16": 65.0, "fp32": 8.1}),  # Turing: no bf16 or tf32 tensor cores
    "V100 SXM": Gpu({"fp16": 125.0, "fp32": 15.7}),
    "V100 PCIe": Gpu({"fp16": 112.0, "fp32": 14.0}),
    # AMD's datasheet, dense matrix figures; Infinity Fabric to the 7 peers of an 8-GPU platform.
    "MI300X": Gpu({"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}, 196608, 448.0),
}
# Bandwidth between nodes, per node and one direction, in GB/s: 8 x 400 Gb/s NDR InfiniBand HCAs
# (one per GPU, as in a DGX H100), or one 100 Gb/s Ethernet port.
INTERCONNECTS = {"infiniband": 400.0, "ethernet": 12.5, "nvlink": 900.0 * 8}  # nvlink: an NVL72-style rack
PCIE_GB_S = 25.0  # host <-> GPU, one direction, PCIe Gen4 x16 in practice
NVME_GB_S = 6.0  # one local NVMe drive per node, read or write
PCIE_PEER_GB_S = 32.0  # GPU to GPU over PCIe Gen4 x16, one direction: cards without NVLink
GPU_NAME_RULES = [
    ("GB200", None, "GB200"),
    ("GH200", None, "GH200"),
    ("H200", "NVL", "H200 NVL"),
    ("H200", None, "H200 SXM"),
    ("H100", "NVL", "H100 NVL"),
    ("H100", "PCIE", "H100 PCIe"),
    ("H100", None, "H100 SXM"),
    ("H800", "PCIE", "H800 PCIe"),
    ("H800", None, "H800 SXM"),
    ("H20", None, "H20"),
    ("B200", None, "B200"),
    ("A100", "40GB", "A100 40GB"),
    ("A100", None, "A100"),
    ("L40S", None, "L40S"),
    ("L40", None, "L40"),
    ("L4", None, "L4"),
    ("A40", None, "A40"),
    ("A10G", None, "A10G"),
    ("A10", None, "A10"),
    ("A6000", None, "RTX A6000"),
    ("4090", None, "RTX 4090"),
    ("T4", None, "T4"),
    ("V100", "PCIE", "V100 PCIe"),
    ("V100", None, "V100 SXM"),
    ("MI300X", None, "MI300X"),
]
# Rows of Lightning's table (lightning.fabric.utilities.throughput._CUDA_FLOPS) that are wrong for MFU:
# H200 and H100 NVL list the sparse peaks (2000, 1700, 1979 bf16), and the H200 keys ("h200 sxm1")
# never match the names torch reports; the GeForce RTX 30xx/40xx, RTX A6000, A40 and Titan RTX rows
# list the non-tensor fp32 rate as bf16/fp16 (the A40 does 149.7 dense bf16, not 37.4); the RTX 20xx
# rows list the non-tensor fp16 rate. Its other rows (A100, H100 SXM/PCIe, L4, L40, A10G, T4, V100,
# V100S, Quadro RTX 5000) agree with the datasheets.
LIGHTNING_ROWS_NOT_USED = ("h200", "h100 nvl", "rtx 40", "rtx 30", "rtx 20", "a6000", "a40", "titan rtx")
LIGHTNING_COLUMN = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "tf32": "tfloat32",
    "fp32": "float32",
}  # its keys: torch dtypes


def gpu_model(device_name: str) -> str | None:
    """The row of GPUS for a name as `torch.cuda.get_device_name` reports it ('NVIDIA H200') or a short one ('H100')."""
    words = set(device_name.upper().replace("-", " ").split())
    for word, variant, row in GPU_NAME_RULES:
        if word in words and (variant is None or variant in words):
            return row
    return None


def lightning_peak_tflops(device_name: str, column: str) -> float | None:
    """Dense peak TFLOP/s from Lightning's table for a GPU missing from ours, unless its row is a known wrong one."""
    try:
        import torch
        from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    except ImportError:  # a private table: gone in some Lightning release, then no fallback
        return None
    key = LIGHTNING_COLUMN[column]
    name = f" {' '.join(device_name.lower().replace('-', ' ').split())} "
    for chip in _CUDA_FLOPS:  # whole words only: "a100" is not the "RTX A1000"
        if f" {chip} " in name and not chip.startswith(LIGHTNING_ROWS_NOT_USED):
            flops = _CUDA_FLOPS[chip].get(getattr(torch, key, key))
            return flops / 1e12 if flops else None
    return None


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of one GPU at a recipe precision; None when neither table has the GPU at that precision."""
    row = gpu_model(device_name)
    column = table_column(precision, tf32)
    if row is not None:
        return GPUS[row].peaks.get(column)
    return lightning_peak_tflops(device_name, column)
