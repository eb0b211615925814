"""The device `plan` and `rehearse` assume: a row of the GPU table (hardware.py) or a CPU process, its memory
overridable. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..recipe.schema import Recipe

if TYPE_CHECKING:
    from .plan import Device


def plan_device(options: Any, recipe: Recipe) -> Device:
    """The device of `options.gpu` (a row of the hardware table), or a CPU process for a CPU recipe; its memory
    `options.gpu_memory_gib` when given."""
    from ..precision import table_column
    from .hardware import GPUS, PCIE_PEER_GB_S, gpu_model
    from .plan import Device

    memory = int(options.gpu_memory_gib * 2**30) if options.gpu_memory_gib else None
    if recipe.accelerator == "cpu":
        name = "CPU" + ("" if memory else " (16 GiB per process assumed; set --gpu_memory_gib)")
        return Device(name, memory or 16 * 2**30, None, 0.0)
    row = gpu_model(options.gpu)
    if row is None:
        known = ", ".join(name for name, gpu in GPUS.items() if gpu.memory_mib)
        raise RecipeError(f"--gpu={options.gpu}: not in the table (choose {known}, or another row of hardware.py)")
    gpu = GPUS[row]
    if memory is None and gpu.memory_mib is None:
        raise RecipeError(f"--gpu={options.gpu}: the table has no memory figure for the {row} (add --gpu_memory_gib)")
    name = f"{row} ({options.gpu_memory_gib:g} GiB)" if memory else row
    peak = gpu.peaks.get(table_column(recipe.precision))
    return Device(name, memory or (gpu.memory_mib or 0) * 2**20, peak, gpu.intra_node_gb_s or PCIE_PEER_GB_S)
