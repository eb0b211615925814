"""What the toy MLP costs to train, by formula and without torch: `MlpShape` is the task's `ModelCost`
(tasks/base.py), what `plan` reads. A block holds a LayerNorm of `width` and two linear layers (width -> 2 width
-> width, with biases); tensor parallel splits fc by columns and proj by rows (proj's bias stays whole).
Activations count what autograd saves per block: the LayerNorm's input (residual stream, r bytes) and its
statistics, its output, fc's output and GELU's output (a bytes each), and under autocast the 16-bit weight copies.
There is no published formula for this model: the `paper` figures are these counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from {{ cookiecutter.package_name }}.precision import MIXED, activation_bytes
from {{ cookiecutter.package_name }}.tasks.base import Activations

from .config import MlpConfig


@dataclass(frozen=True)
class MlpShape:
    """The sizes that decide the toy MLP's parameters, activations and FLOPs."""

    config: MlpConfig

    @property
    def n_layer(self) -> int:
        return self.config.depth

    def _split_and_replicated(self) -> tuple[int, int]:
        """One block's linear parameters: (split by tensor parallel, kept whole: proj's bias)."""
        w = self.config.width
        return (w * 2 * w + 2 * w) + 2 * w * w, w

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        split, replicated = self._split_and_replicated()
        return split // tensor_parallel + replicated + 2 * self.config.width  # + the LayerNorm

    def parameters(self, tensor_parallel: int = 1) -> int:
        c = self.config
        ends = (c.inputs * c.width + c.width) + (c.width * c.outputs + c.outputs)
        return ends + c.depth * self.layer_parameters(tensor_parallel)

    def tensor_parallel_problem(self, tensor_parallel: int) -> str | None:
        return "the hidden units" if (2 * self.config.width) % tensor_parallel else None

    def describe(self) -> str:
        c = self.config
        return f"depth={c.depth}, width={c.width}, {c.inputs} inputs, {c.outputs} outputs"

    def layer_activations(self, micro_batch: int, precision: str, tensor_parallel: int = 1) -> float:
        a, r = activation_bytes(precision)
        b, w, t = micro_batch, self.config.width, tensor_parallel
        norm = r * b * w + 2 * 4 * b + a * b * w
        hidden = 2 * a * b * 2 * w / t
        weights = 0.0
        if precision in MIXED:
            split, replicated = self._split_and_replicated()
            weights = 2 * (split / t + replicated)
        return norm + hidden + weights

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        if sixteen_bit_module and precision in MIXED:
            precision = "bf16-true"
        _, r = activation_bytes(precision)
        c, b = self.config, micro_batch
        layer = self.layer_activations(micro_batch, precision, tensor_parallel)
        outside = 4 * b * c.inputs + r * b * c.width + 4 * b * c.outputs  # the inputs, the input layer, the head
        held = c.depth * layer + outside
        checkpointed = c.depth * r * b * c.width + outside
        loss_gradients = 2 * 4 * b * c.outputs  # of the log-softmax and of the outputs
        return Activations(
            held, checkpointed, held, checkpointed, recompute_peak=layer, backward_transient=loss_gradients
        )

    def tensor_parallel_elements(self, micro_batch: int) -> float:
        """Two all-reduces of b*w per block per micro-batch (proj's output in forward, fc's input in backward)."""
        return 2 * self.config.depth * micro_batch * self.config.width

    def tensor_parallel_all_reduces(self, checkpointed: bool) -> int:
        """proj's output in forward, fc's input gradient in backward (checkpointing recomputes neither's)."""
        return 2

    def hidden_elements(self, micro_batch: int) -> float:
        """b*w: one block's output for a micro-batch (what a pipeline stage sends the next)."""
        return micro_batch * self.config.width

    def training_flops_per_sample(self) -> float:
        c = self.config
        blocks = c.depth * 2 * (2 * c.width * c.width)  # fc and proj
        return 6.0 * (c.inputs * c.width + blocks + c.width * c.outputs)
