"""GPUs by the name torch reports: their dense peak TFLOP/s at each precision, for MFU (observe.py)."""

from __future__ import annotations

import torch

# Dense peak tensor TFLOP/s of one GPU, from NVIDIA's datasheets and architecture whitepapers, which
# quote tensor figures "with sparsity" (2:4 structured sparsity, twice the dense rate a training run
# can reach): the dense figure is half of that. fp32 is the non-tensor rate; tf32 applies to 32-true
# when torch.backends.cuda.matmul.allow_tf32 is on. bf16/fp16 are with fp32 accumulation (what
# PyTorch uses; GeForce cards run fp16 accumulation twice as fast). A GPU missing here falls back to
# Lightning's table (LIGHTNING_ROWS_NOT_USED says which of its rows are wrong and skipped).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0},  # GB200 NVL72: 360 PF sparse bf16 / 72 GPUs / 2
    "B200": {"bf16": 2250.0, "fp16": 2250.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H200 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    # The export variants: H800 computes as the H100 (less NVLink bandwidth); H20 is a cut-down Hopper.
    "H800 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H20": {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # AWS's A10G has no NVIDIA datasheet; like Lightning, the A10's figures (set logger.peak_tflops to override).
    "A10G": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # Ada whitepaper, fp32 accumulate
    "T4": {"fp16": 65.0, "fp32": 8.1},  # Turing: no bf16 or tf32 tensor cores
    "V100 SXM": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
}
# (word in the device name, second word or None, table row): the first match wins, so variants first.
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
]
PRECISION_COLUMN = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
# Rows of Lightning's table (lightning.fabric.utilities.throughput._CUDA_FLOPS) that are wrong for MFU:
# H200 and H100 NVL list the sparse peaks (2000, 1700, 1979 bf16), and the H200 keys ("h200 sxm1")
# never match the names torch reports; the GeForce RTX 30xx/40xx, RTX A6000, A40 and Titan RTX rows
# list the non-tensor fp32 rate as bf16/fp16 (the A40 does 149.7 dense bf16, not 37.4); the RTX 20xx
# rows list the non-tensor fp16 rate. Its other rows (A100, H100 SXM/PCIe, L4, L40, A10G, T4, V100,
# V100S, Quadro RTX 5000) agree with the datasheets.
LIGHTNING_ROWS_NOT_USED = ("h200", "h100 nvl", "rtx 40", "rtx 30", "rtx 20", "a6000", "a40", "titan rtx")
LIGHTNING_COLUMN: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": "tfloat32",
    "fp32": torch.float32,
}


def gpu_model(device_name: str) -> str | None:
    """The row of PEAK_TFLOPS for a name as `torch.cuda.get_device_name` reports it, e.g. 'NVIDIA H200'."""
    words = set(device_name.upper().replace("-", " ").split())
    for word, variant, row in GPU_NAME_RULES:
        if word in words and (variant is None or variant in words):
            return row
    return None


def lightning_peak_tflops(device_name: str, column: str) -> float | None:
    """Dense peak TFLOP/s from Lightning's table for a GPU missing from ours, unless its row is a known wrong one."""
    try:
        from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    except ImportError:  # a private table: gone in some Lightning release, then no fallback
        return None
    name = f" {' '.join(device_name.lower().replace('-', ' ').split())} "
    for chip in _CUDA_FLOPS:  # whole words only: "a100" is not the "RTX A1000"
        if f" {chip} " in name and not chip.startswith(LIGHTNING_ROWS_NOT_USED):
            flops = _CUDA_FLOPS[chip].get(LIGHTNING_COLUMN[column])
            return flops / 1e12 if flops else None
    return None


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of one GPU at a recipe precision; None when neither table has the GPU at that precision."""
    row = gpu_model(device_name)
    column = PRECISION_COLUMN.get(precision, "tf32" if tf32 else "fp32")
    if row is not None:
        return PEAK_TFLOPS[row].get(column)
    return lightning_peak_tflops(device_name, column)
