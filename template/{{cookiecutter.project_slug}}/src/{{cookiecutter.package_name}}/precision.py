"""Precision, in one place: the names a recipe takes, which need a GPU, which keep 16-bit copies, what each
stores per parameter and per activation, the column of the GPU table it computes in, and fully_shard's
mixed-precision policy.

Model states (Rajbhandari et al. 2019, "ZeRO", section 3.1 and figure 1): mixed-precision Adam holds
2 bytes of low-precision parameters, 2 of low-precision gradients and K = 12 of fp32 optimizer state
(master weights, momentum, variance) per parameter. Stage 1 partitions the K part over the N_d
data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters:

    stage 0 (ddp)  (2 + 2 + K) * P            stage 2  (2 + (2 + K) / N_d) * P
    stage 1        (2 + 2 + K / N_d) * P      stage 3  (2 + 2 + K) * P / N_d

fp32 training is the same with 4 + 4 + K, K = 8 (momentum and variance; the parameters are their own
master copy); bf16-true with 2 + 2 + K, K = 4 (torch's AdamW keeps its moments in the parameters' dtype).

Imports no torch (recipes are checked and `plan` runs without it); `mixed_precision_policy` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
MIXED = ("bf16-mixed", "16-mixed")  # autocast: fp32 parameters, 16-bit matmuls
HALF_TRUE = ("bf16-true", "16-true")  # the parameters themselves in 16 bits
GPU_ONLY = ("16-mixed", "16-true")  # fp16 needs a GPU (and a loss scaler under 16-mixed)
BF16_CAPABILITY = (8, 0)  # CUDA compute capability with bf16: A100 and newer
# The column of the GPU table (planner/hardware.py) each precision computes in; fp32 (or tf32) otherwise.
TABLE_COLUMN = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}


def table_column(precision: str, tf32: bool = False) -> str:
    """The column of the GPU table a recipe precision computes in."""
    return TABLE_COLUMN.get(precision, "tf32" if tf32 else "fp32")


@dataclass(frozen=True)
class States:
    """Bytes of parameters, gradients and optimizer state one device holds."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, K optimizer) bytes per parameter in the ZeRO paper's terms."""
    if precision in MIXED:
        return 2, 2, 12
    if precision in HALF_TRUE:
        return 2, 2, 4
    return 4, 4, 8


def zero_model_states(
    parameters: float, precision: str, stage: int, data_parallel: int, trained: float = 1.0
) -> States:
    """Model states per device under ZeRO stage 0 (ddp) to 3 over `data_parallel` ranks, as in the paper.
    `trained`: the share of the parameters that train (adapters train a small one); a frozen parameter has no
    gradient, no optimizer state and no master copy: it holds its weight as torch keeps it."""
    weight, grad, optim = bytes_per_parameter(precision)
    frozen = torch_model_states(parameters * (1 - trained), precision, stage, data_parallel).parameters
    return States(
        parameters=weight * parameters * trained / (data_parallel if stage >= 3 else 1) + frozen,
        gradients=grad * parameters * trained / (data_parallel if stage >= 2 else 1),
        optimizer=optim * parameters * trained / (data_parallel if stage >= 1 else 1),
    )


def torch_model_states(
    parameters: float, precision: str, stage: int, data_parallel: int, trained: float = 1.0
) -> States:
    """What torch's AdamW under Fabric holds (ddp: stage 0, fully_shard: stage 3): the parameters are the master copy.

    Under bf16-mixed the parameters and gradients stay fp32 and autocast computes in bf16, so the
    16 bytes split 4 + 4 + 8 instead of the paper's 2 + 2 + 12; the total is the same. `trained`: the share of
    the parameters with gradients and optimizer state (adapters); the frozen rest holds its weights only.
    """
    weight, grad, optim = (2, 2, 4) if precision in HALF_TRUE else (4, 4, 8)
    shard, trained_parameters = data_parallel if stage == 3 else 1, parameters * trained
    return States(weight * parameters / shard, grad * trained_parameters / shard, optim * trained_parameters / shard)


def activation_bytes(precision: str) -> tuple[int, int]:
    """(bytes of an activation in the compute dtype, bytes of the residual stream) under a precision."""
    if precision in MIXED:
        return 2, 4  # autocast computes matmuls in 16 bits; additions and norms stay fp32
    if precision in HALF_TRUE:
        return 2, 2
    return 4, 4


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """fully_shard's policy. bf16-mixed: gather the fp32 shards in bf16, compute in bf16, reduce gradients in fp32
    (as torchtitan does).

    Without it autocast would cast every gathered fp32 weight to bf16 at each matmul and keep that copy
    for backward, beside the fp32 one: twice the all-gather volume and 2 bytes per parameter of every
    layer held until backward, and the residual stream in fp32. The sharded parameters, their gradients
    and AdamW's moments stay fp32 (the master copy); Fabric's autocast still runs the loss in fp32.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fully_shard's default: compute in the parameters' dtype
