"""Accelerators and links `plan` can assume: memory, dense peak FLOP/s, bandwidths (vendor datasheet figures).

Memory is what the driver reports as the device total (nvidia-smi / rocm-smi), in MiB. Peaks are dense
tensor-core figures (datasheets often quote twice these, "with sparsity"); fp32 is the non-tensor rate
(torch does not use TF32 for matmuls unless asked). `intra_node_gb_s` is one GPU's bandwidth to its
peers in one direction: NVLink / Infinity Fabric, or PCIe on cards without it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    """One accelerator model."""

    name: str
    memory_bytes: int
    bf16_tflops: float
    fp32_tflops: float
    intra_node_gb_s: float

    def peak_tflops(self, precision: str) -> float:
        """Dense peak TFLOP/s at a recipe precision."""
        return self.fp32_tflops if precision == "32-true" else self.bf16_tflops


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("A100-40GB", 40960 * MIB, 312.0, 19.5, 300.0),
        Gpu("A100-80GB", 81920 * MIB, 312.0, 19.5, 300.0),
        Gpu("H100", 81559 * MIB, 989.4, 67.0, 450.0),
        Gpu("H200", 143771 * MIB, 989.4, 67.0, 450.0),
        Gpu("B200", 183359 * MIB, 2250.0, 80.0, 900.0),
        Gpu("L40S", 46068 * MIB, 362.05, 91.6, 32.0),
        Gpu("L4", 23034 * MIB, 121.0, 30.3, 32.0),
        Gpu("A10", 23028 * MIB, 125.0, 31.2, 32.0),
        Gpu("RTX-4090", 24564 * MIB, 165.2, 82.6, 32.0),
        Gpu("MI300X", 196608 * MIB, 1307.4, 163.4, 448.0),
    )
}

# Bandwidth between nodes, per node and one direction, in GB/s: 8 x 400 Gb/s NDR InfiniBand HCAs
# (one per GPU, as in a DGX H100), or one 100 Gb/s Ethernet port.
INTERCONNECTS = {"infiniband": 400.0, "ethernet": 12.5, "nvlink": 900.0 * 8}  # nvlink: an NVL72-style rack
PCIE_GB_S = 25.0  # host <-> GPU, one direction, PCIe Gen4 x16 in practice
NVME_GB_S = 6.0  # one local NVMe drive per node, read or write
