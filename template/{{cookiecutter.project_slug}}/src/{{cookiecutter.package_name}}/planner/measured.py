"""A task's `ModelCost` measured instead of written: what `plan` weighs for a task without size formulas
(`Task.model_cost()` is None).

Two measurements stand in for the formulas. The model built on the meta device (no memory, no init) gives the
parameters and each block's (`model_sizes`). One optimizer step of the recipe on one rank with nothing sharded,
rehearsed on fake tensors (commands/plan.py runs it through `rehearse`), gives what the step held at its peak beyond
the model states (`beyond_model_states`): the activations of one micro-batch, what backward holds beside them, and the
buffers. From these plan.py derives every data-parallel candidate as it does from formulas: the ZeRO paper's model
states over the ranks, each runtime's terms from a block's parameters, these activations on every rank.

What one rank without sharding does not show is not estimated: how a layer splits over tensor-parallel ranks and what
a pipeline stage holds and sends (those candidates are refused, `NOT_ESTIMATED`). Activations are taken to grow with
the micro batch in proportion from the one measured; checkpointing saves what a second rehearsal, with every block
checkpointed, measures, or nothing until it is measured. FLOPs come from the task's `flops_per_unit` when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..tasks.base import Activations

if TYPE_CHECKING:
    from ..tasks.base import Task
    from .options import PlanOption

NOT_ESTIMATED = (
    "not estimated: the task has no size formulas (Task.model_cost), and one rank without sharding shows neither how"
    " a layer splits over tensor-parallel ranks nor what a pipeline stage holds"
)
# torch's memory tracker names what it tracks by kind (_MemRefType); these three are the model states, which the plan's
# formulas give per candidate, and buffers are held whole on every rank whatever the micro batch.
MODEL_STATE_KINDS = ("PARAM", "GRAD", "OPT")
BUFFER_KINDS = ("BUFFER",)


def estimated(option: PlanOption) -> bool:
    """Whether a measurement on one rank without sharding estimates this candidate: a data-parallel layout."""
    return option.layout() == (1, 1)


@dataclass(frozen=True)
class ModelSizes:
    """The model's parameters, and each block's (the unit a sharded runtime gathers)."""

    parameters: int
    blocks: tuple[int, ...]


def model_sizes(task: Task) -> ModelSizes:
    """The parameters of the task's model, built on the meta device (`checked_model`: the contract is checked)."""
    import torch

    from ..tasks.base import checked_model

    with torch.device("meta"):
        model: Any = checked_model(task)
    blocks = tuple(sum(parameter.numel() for parameter in block.parameters()) for block in model.blocks)
    return ModelSizes(sum(parameter.numel() for parameter in model.parameters()), blocks)


def beyond_model_states(rank: dict[str, Any]) -> tuple[float, float]:
    """(buffers, the rest) of what a rehearsed rank held at its step's peak besides its model states, from the
    rehearsal's `peak_by_kind` (training/rehearsal.py): the rest is activations, what backward holds beside them and
    the temporaries of the moment."""
    kinds = {str(kind).rsplit(".", 1)[-1]: float(size) for kind, size in rank["peak_by_kind"].items()}
    kinds.pop("Total", None)
    buffers = sum(size for kind, size in kinds.items() if kind in BUFFER_KINDS)
    rest = sum(size for kind, size in kinds.items() if kind not in (*MODEL_STATE_KINDS, *BUFFER_KINDS))
    return buffers, rest


@dataclass(frozen=True)
class MeasuredCost:
    """A `ModelCost` (tasks/base.py) from measurements: sizes of the meta build, activations of a rehearsed step."""

    sizes: ModelSizes
    micro_batch: int  # the micro batch the step was rehearsed at
    buffers: float  # bytes every rank holds whole
    activations_measured: float  # at the peak beyond the model states and buffers, without checkpointing
    checkpointed_measured: float | None = None  # the same with every block checkpointed; None: not measured
    flops_per_sample: float = 0.0  # the task's flops_per_unit x units per sample; 0: unknown

    @property
    def n_layer(self) -> int:
        return len(self.sizes.blocks)

    def parameters(self, tensor_parallel: int = 1) -> int:
        return self.sizes.parameters  # tensor parallel is not estimated (NOT_ESTIMATED)

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        return sum(self.sizes.blocks) // max(1, self.n_layer)  # the blocks' mean: the root keeps the remainder

    def tensor_parallel_problem(self, tensor_parallel: int) -> str | None:
        return None  # its candidates are refused as a whole (NOT_ESTIMATED)

    def describe(self) -> str:
        checkpointed = "; with checkpointing too" if self.checkpointed_measured is not None else ""
        return (
            f"no size formulas: {self.n_layer} blocks, activations measured by rehearsing one step of micro batch"
            f" {self.micro_batch} on one rank{checkpointed}"
        )

    def _per_micro_batch(self, measured: float, micro_batch: int) -> float:
        return self.buffers + measured * micro_batch / self.micro_batch

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        held = self._per_micro_batch(self.activations_measured, micro_batch)
        measured = self.checkpointed_measured
        checkpointed = held if measured is None else self._per_micro_batch(measured, micro_batch)
        # The rehearsed peaks already hold the block that backward rebuilds and the loss's gradients.
        return Activations(held, checkpointed, held, checkpointed, recompute_peak=0.0, backward_transient=0.0)

    def layer_activations(self, micro_batch: int, precision: str) -> float:
        return self.activations_measured * micro_batch / self.micro_batch / max(1, self.n_layer)

    def tensor_parallel_elements(self, micro_batch: int) -> float:
        return 0.0

    def tensor_parallel_all_reduces(self, checkpointed: bool) -> int:
        return 0  # its tensor-parallel candidates are refused as a whole (NOT_ESTIMATED)

    def hidden_elements(self, micro_batch: int) -> float:
        return 0.0

    def training_flops_per_sample(self) -> float:
        return self.flops_per_sample
