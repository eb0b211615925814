"""What the ViT costs to train, by formula and without torch: parameters, activations, FLOPs per image.

`ViTShape` is the task's `ModelCost` (tasks/base.py): what `plan` reads. A ViT block is a pre-norm encoder
block (q, k, v, proj and a GELU MLP, all with biases, LayerNorm with bias), run over s = patches + 1
tokens per image; the tensor-parallel plan splits q, k, v, fc by columns and the projections by rows.

Activations count what autograd saves, as tasks/language_model/sizing.py does for the decoder: per block
the two LayerNorm inputs (residual stream, r bytes) and their outputs (a bytes), q, k, v and the attention
output, the MLP's two hidden activations, and under autocast the 16-bit copy of each weight; outside the
blocks, the images, the patch embedding's output, the final norm and the class token's logits. The
paper figure is Korthikanti et al. 2022's s*b*h*(10 + 24/t + 5*a*s/(h*t)) per layer.
FLOPs are model FLOPs, 6 x (matmul parameters per token) plus attention's 12 * n_layer * n_embd * s per
token, summed over an image's tokens (the patch projection over patches, the head over the class token).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...precision import MIXED, activation_bytes
from ..base import Activations
from .config import ViTConfig


@dataclass(frozen=True)
class ViTShape:
    """The sizes that decide a ViT's parameters, activations and FLOPs."""

    config: ViTConfig

    @property
    def n_layer(self) -> int:
        return self.config.n_layer

    def _split_and_replicated(self) -> tuple[int, int]:
        """One block's linear parameters: (split by tensor parallel, kept whole: the row-parallel biases)."""
        h, ffn = self.config.n_embd, self.config.mlp_hidden_size
        split = 3 * (h * h + h) + h * h + (h * ffn + ffn) + ffn * h
        return split, 2 * h

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        split, replicated = self._split_and_replicated()
        return split // tensor_parallel + replicated + 2 * 2 * self.config.n_embd  # + two LayerNorms

    def parameters(self, tensor_parallel: int = 1) -> int:
        c = self.config
        patch = c.channels * c.patch_size**2 * c.n_embd + c.n_embd
        tokens = c.n_embd + c.sequence_length * c.n_embd  # class token, positions
        head = c.n_embd * c.num_classes + c.num_classes
        return patch + tokens + c.n_layer * self.layer_parameters(tensor_parallel) + 2 * c.n_embd + head

    def tensor_parallel_problem(self, tensor_parallel: int) -> str | None:
        return "the heads" if self.config.n_head % tensor_parallel else None

    def describe(self) -> str:
        c = self.config
        return (
            f"n_layer={c.n_layer}, n_embd={c.n_embd}, n_head={c.n_head}, {c.image_size}x{c.image_size}x{c.channels}"
            f" images in {c.patch_size}x{c.patch_size} patches ({c.sequence_length} tokens), {c.num_classes} classes"
        )

    def layer_activations(self, micro_batch: int, precision: str, tensor_parallel: int = 1) -> float:
        a, r = activation_bytes(precision)
        c, t = self.config, tensor_parallel
        tokens, h = c.sequence_length * micro_batch, c.n_embd
        norms = 2 * r * tokens * h + 2 * 2 * 4 * tokens  # inputs, plus mean and 1/std in fp32
        normed = (4 if precision in MIXED else 2) * a * tokens * h  # autocast: q, k, v and fc each save a copy
        attention = 3 * a * tokens * h / t + a * tokens * h / t + 4 * micro_batch * c.n_head * c.sequence_length / t
        mlp = 2 * a * tokens * c.mlp_hidden_size / t
        weights = 0.0
        if precision in MIXED:  # autocast's 16-bit weight copies, saved by each matmul
            split, replicated = self._split_and_replicated()
            weights = 2 * (split / t + replicated)
        return norms + normed + attention + mlp + weights

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        if sixteen_bit_module and precision in MIXED:  # 16-bit blocks; the loss's handful of logits aside
            precision = "bf16-true"
        a, r = activation_bytes(precision)
        c, t = self.config, tensor_parallel
        s, h = c.sequence_length, c.n_embd
        tokens = s * micro_batch
        layer = self.layer_activations(micro_batch, precision, tensor_parallel)
        images = 4 * micro_batch * c.channels * c.image_size**2
        outside = images + r * tokens * h + a * tokens * h + 2 * 4 * tokens + 4 * micro_batch * c.num_classes
        paper_layer = tokens * h * (10 + 24 / t + 5 * c.n_head * s / (h * t))
        return Activations(
            paper=c.n_layer * paper_layer + outside,
            paper_checkpointed=c.n_layer * 2 * tokens * h + outside,
            held=c.n_layer * layer + outside,
            held_checkpointed=c.n_layer * r * tokens * h + outside,
            recompute_peak=layer,
            backward_transient=2 * 4 * micro_batch * c.num_classes,  # the gradients of the log-softmax and logits
        )

    def tensor_parallel_elements(self, micro_batch: int) -> float:
        """The all-reduces of s*b*h per block per micro-batch (a ring all-reduce moves each element twice)."""
        c = self.config
        return 2 * self.tensor_parallel_all_reduces(False) * c.n_layer * c.sequence_length * micro_batch * c.n_embd

    def tensor_parallel_all_reduces(self, checkpointed: bool) -> int:
        """Forward: the two row-parallel outputs; backward: the input gradients of q, k, v and fc, each reduced on
        its own; full checkpointing recomputes the attention's output."""
        return 2 + 4 + (1 if checkpointed else 0)

    def hidden_elements(self, micro_batch: int) -> float:
        """s*b*h: one block's output for a micro-batch (what a pipeline stage sends the next)."""
        return self.config.sequence_length * micro_batch * self.config.n_embd

    def training_flops_per_sample(self) -> float:
        c = self.config
        h, s = c.n_embd, c.sequence_length
        per_token = c.n_layer * (4 * h * h + 2 * h * c.mlp_hidden_size)
        matmul = s * per_token + c.num_patches * c.channels * c.patch_size**2 * h + h * c.num_classes
        return 6 * matmul + 12 * c.n_layer * h * s * s


# ViT-B/16, ViT-L/16 and ViT-H/14 (Dosovitskiy et al. 2021, table 1): the shapes a bare
# parameter count is planned on (`plan --parameters N`), on 224x224 RGB images of 1000 classes.
REFERENCE_SHAPES = ((12, 768, 12, 16), (24, 1024, 16, 16), (32, 1280, 16, 14))


def reference_model(parameters: float) -> dict[str, int]:
    """The model fields of the reference ViT whose parameter count is nearest (by ratio) to `parameters`."""
    import math

    def fields(layers: int, width: int, heads: int, patch: int) -> dict[str, int]:
        return {"image_size": 224, "patch_size": patch, "channels": 3, "num_classes": 1000,
                "n_layer": layers, "n_embd": width, "n_head": heads}  # fmt: skip

    def distance(candidate: dict[str, int]) -> float:
        return abs(math.log(ViTShape(ViTConfig(**candidate)).parameters() / parameters))

    return min((fields(*shape) for shape in REFERENCE_SHAPES), key=distance)
