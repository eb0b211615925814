"""What the language model costs to train, by formula and without torch: parameters, activations, FLOPs.

Everything here is arithmetic on a decoder's shape (`Shape`, the task's `ModelCost` for `plan`), so `plan`
answers for a 1 T-parameter model in milliseconds on a laptop. Each formula names its source:

Model states per precision and ZeRO stage are in precision.py (no model shape enters them).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4): a transformer layer stores s*b*h*(34 + 5*a*s/h) bytes without recomputation (2-byte
activations, 1-byte dropout masks; 5*a*s/h is the attention scores, softmax and its dropout mask),
s*b*h*(10 + 24/t + 5*a*s/(h*t)) under t-way tensor parallelism without sequence parallelism (the
layer norms and dropouts stay replicated), and 2*s*b*h (its input) with full recomputation. The
embeddings and the output layer add about 4*s*b*h*(1 + v/h)/t (as the paper gives it, with sequence
parallelism), the cross entropy's fp32 logits being the s*b*v part. `activations` gives that paper figure and, beside it, the count for this
project's GPT, derived the same way from what its autograd graph saves:

    per layer, pre-norm block, fused scaled-dot-product attention, no dropout (pre-training):
      layer-norm inputs         2 * r * s*b*h     (r: bytes of the residual stream, fp32 under mixed precision)
      normed inputs of q/k/v, fc  2 * a * s*b*h   (a: bytes of an activation in the compute dtype; under autocast
                                  each linear casts and saves its own copy: 4 * a * s*b*h, SwiGLU 5 * a * s*b*h)
      q, k, v                   a * s*b*(h + 2*h_kv) / t
      attention output          a * s*b*h / t     (and its logsumexp, 4 * b*heads*s / t: no s*s scores are stored)
      fc output, GELU output    2 * a * s*b*ffn / t   (SwiGLU: 4 * a * s*b*ffn / t: gate, up, SiLU(gate), product)
      under bf16-mixed / 16-mixed, the low-precision copy of each weight that autocast makes and the
      matmul saves for backward: 2 * (layer weights) / t
    with activation checkpointing: r * s*b*h per checkpointed layer (its input), plus one layer's
    activations while backward recomputes it
    embeddings and head: the token ids (8 bytes each), the final norm's input and output, and the log-softmax
    of the logits, s*b*v in fp32 (cross entropy runs in fp32 under autocast); backward begins with two more
    logits-sized tensors (the gradients of the log-softmax and of the logits) while all of that is still held
    A 16-bit module (fsdp2/hsdp under fully_shard's MixedPrecisionPolicy, DeepSpeed under bf16-mixed) is
    counted as bf16-true: r = a = 2 and no weight copies (measured: tests/e2e/test_mixed_precision.py), its loss
    in fp32 as autocast computes it.

The tensor-parallel plan of this project splits q, k, v, fc by columns and the output projections by
rows, with no sequence parallelism: norms, residuals and the head stay whole on every rank.

A mixture of experts (E routed experts of hidden width f_e, k of them per token, shared experts of total width
f_s, a router h*E) holds every expert, 3*h*f_e*E + 3*h*f_s + h*E per layer: parameters, model states and memory
count them all. A token passes through k experts only: its FLOPs are 6 * (active matmul parameters, the MLP's
being 3*h*f_e*k + 3*h*f_s + h*E) + 12 * n_layer * n_embd * s (`active_parameters`; MFU uses them), and its
activations are those of a dense MLP of width k*f_e + f_s (`ffn_hidden`: the experts' SwiGLU over the s*b*k rows
dispatched to them) plus the dispatch buffers, 2 * a * s*b*k*h: the rows sorted by expert, which the experts' first
matmuls save, and the experts' outputs, which the combine's weighting saves (under expert parallelism the rows
received by all-to-all take the sorted rows' place, routing balanced). The routing's own small tensors (scores,
indices) are left out. `expert_sizes` hands plan what expert parallelism splits (the routed experts) and moves (the
s*k rows of h per sample that each all-to-all carries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...precision import HALF_TRUE, MIXED, activation_bytes
from ..base import Activations, ExpertSizes
from .families import family_part


@dataclass(frozen=True)
class Shape:
    """The sizes that decide a decoder-only transformer's parameters, activations and FLOPs."""

    vocab_size: int
    sequence_length: int
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int  # width of the MLP's hidden layer (of each of SwiGLU's two input projections)
    gated_mlp: bool = False  # SwiGLU: gate and up projections, then down
    bias: bool = False
    norm_has_bias: bool = False  # LayerNorm with bias; RMSNorm has none
    learned_positions: bool = True
    tied_embeddings: bool = False
    experts: int = 0  # routed experts of a mixture of experts (0: a dense MLP); ffn_hidden is then the active width
    experts_per_token: int = 0  # top_k
    expert_hidden: int = 0  # hidden width of each expert's SwiGLU
    shared_hidden: int = 0  # total hidden width of the shared experts
    document_ids: bool = False  # a sample carries each position's example id (packed sft, data.document_mask)

    def active_parameters(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to."""
        unused = (self.experts - self.experts_per_token) * 3 * self.n_embd * self.expert_hidden
        return count_parameters(self) - self.n_layer * unused

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    # --- the task's ModelCost (tasks/base.py): what `plan` asks ---------------------------------------

    def parameters(self, tensor_parallel: int = 1) -> int:
        return count_parameters(self, tensor_parallel)

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        return layer_parameters(self, tensor_parallel)

    def pipeline_end_parameters(self, tensor_parallel: int = 1) -> tuple[int, int]:
        """(before the blocks, after them): the embeddings on the first pipeline stage, the final norm and the head
        on the last (neither split by tensor parallel)."""
        before = self.vocab_size * self.n_embd + (self.sequence_length * self.n_embd if self.learned_positions else 0)
        return before, count_parameters(self, tensor_parallel) - before - self.n_layer * self.layer_parameters(
            tensor_parallel
        )

    def expert_sizes(self) -> ExpertSizes | None:
        if not self.experts:
            return None
        routed = 3 * self.n_embd * self.expert_hidden * self.experts
        rows = self.sequence_length * self.experts_per_token
        return ExpertSizes(self.n_layer, self.experts, routed, rows * self.n_embd)

    def tensor_parallel_problem(self, tensor_parallel: int) -> str | None:
        if self.shared_hidden % tensor_parallel:
            return "the shared experts' width"
        return "the heads" if self.n_head % tensor_parallel or self.n_kv_head % tensor_parallel else None

    def describe(self) -> str:
        shape = f"n_layer={self.n_layer}, n_embd={self.n_embd}, n_head={self.n_head}, vocab_size={self.vocab_size}"
        if self.experts:
            shape += f", {self.experts} experts, top-{self.experts_per_token}, {self.active_parameters():,} active"
        return f"{shape}, sequence {self.sequence_length}"

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        return activations(self, micro_batch, precision, tensor_parallel, sixteen_bit_module=sixteen_bit_module)

    def layer_activations(self, micro_batch: int, precision: str) -> float:
        return layer_activations(self, micro_batch, precision)

    def tensor_parallel_elements(self, micro_batch: int) -> float:
        """The all-reduces of s*b*h per layer per micro-batch (a ring all-reduce moves each element twice); a mixture
        of experts' one of its routing weights (s*b*k) besides."""
        reduces = self.tensor_parallel_all_reduces(False) - (1 if self.experts else 0)
        per_layer = reduces * self.n_embd + (self.experts_per_token if self.experts else 0)
        return 2 * self.n_layer * self.sequence_length * micro_batch * per_layer

    def tensor_parallel_all_reduces(self, checkpointed: bool) -> int:
        """Forward: the two row-parallel outputs (attention, MLP). Backward: the input gradient of each
        column-parallel linear, reduced on its own: q, k, v, and fc (SwiGLU: gate and up). Full checkpointing
        recomputes the attention's output, which the second norm saves, and stops before the MLP's.

        A mixture of experts (token_split.py): forward, the routed experts' output summed; backward, the gradients of
        their input and of the routing weights; shared experts as a SwiGLU, whose output checkpointing recomputes (the
        routed experts' saved tensors come after it)."""
        attention = 1 + 3 + (1 if checkpointed else 0)
        if not self.experts:
            return attention + 1 + (2 if self.gated_mlp else 1)
        return attention + 1 + 2 + (1 + 2 + (1 if checkpointed else 0) if self.shared_hidden else 0)

    def hidden_elements(self, micro_batch: int) -> float:
        """s*b*h: one block's output for a micro-batch (what a pipeline stage sends the next)."""
        return self.sequence_length * micro_batch * self.n_embd

    def training_flops_per_sample(self) -> float:
        return training_flops_per_token(self) * self.sequence_length


def model_shape(model: Any) -> Shape:
    """The shape of the model a `ModelConfig` describes, from its family (families/<arch>/sizing.py)."""
    return family_part(model.arch, "sizing").shape(model)


def layer_linear_parameters(shape: Shape) -> tuple[int, int]:
    """Parameters of one layer's linear layers: (split by tensor parallel, replicated by it).

    Column-parallel layers (q, k, v, fc / gate, up) split weights and biases; row-parallel output
    projections split their weights but every rank keeps the whole bias.
    """
    h, kv, ffn = shape.n_embd, shape.kv_width, shape.ffn_hidden
    inputs = 2 if shape.gated_mlp else 1
    split = h * (h + 2 * kv) + h * h + inputs * h * ffn + ffn * h
    replicated = 0
    if shape.experts:  # where the MLP was: the shared experts split as it; the routed ones divided over the ranks as
        # data-parallel ones (token_split.py: a rank's states hold 1/t of them, as if split); the router replicated
        split += 3 * h * (shape.experts * shape.expert_hidden + shape.shared_hidden) - (inputs * h * ffn + ffn * h)
        replicated += h * shape.experts
    if shape.bias:
        split += h + 2 * kv + inputs * ffn
        replicated += 2 * h
    return split, replicated


def norm_parameters(shape: Shape) -> int:
    """Parameters of one normalisation layer."""
    return shape.n_embd * (2 if shape.norm_has_bias else 1)


def layer_parameters(shape: Shape, tensor_parallel: int = 1) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (the unit FSDP gathers)."""
    split, replicated = layer_linear_parameters(shape)
    return split // tensor_parallel + replicated + 2 * norm_parameters(shape)


def count_parameters(shape: Shape, tensor_parallel: int = 1) -> int:
    """Parameters of the whole model (on one tensor-parallel rank when tensor_parallel > 1)."""
    embeddings = shape.vocab_size * shape.n_embd
    positions = shape.sequence_length * shape.n_embd if shape.learned_positions else 0
    head = 0 if shape.tied_embeddings else shape.vocab_size * shape.n_embd
    layers = shape.n_layer * layer_parameters(shape, tensor_parallel)
    return embeddings + positions + layers + norm_parameters(shape) + head


def model_parameters(model: Any) -> int:
    """Parameters of the model a `ModelConfig` describes: equals `models.count_parameters`, without torch."""
    return count_parameters(model_shape(model))


# --- reference shapes: what `plan --parameters N` plans a bare count on ---------------------------

# GPT-3 (Brown et al. 2020, table 2.1; 1.3 B with 16 heads so they divide the width), Llama-30B/70B
# widths, and the 1 T model of Narayanan et al. 2021: the shape a bare parameter count is planned on.
REFERENCE_SHAPES = (
    (12, 768, 12),
    (24, 1024, 16),
    (24, 1536, 16),
    (24, 2048, 16),
    (32, 2560, 32),
    (32, 4096, 32),
    (40, 5120, 40),
    (60, 6656, 52),
    (80, 8192, 64),
    (96, 12288, 96),
    (128, 25600, 160),
)


def reference_model(parameters: float, vocab_size: int = 50304, block_size: int = 2048) -> dict[str, int]:
    """The model fields of the reference shape whose parameter count is nearest (by ratio) to `parameters`."""

    def fields(layers: int, width: int, heads: int) -> dict[str, int]:
        return {"vocab_size": vocab_size, "block_size": block_size, "n_layer": layers, "n_embd": width, "n_head": heads}

    def distance(candidate: dict[str, int]) -> float:
        shape = Shape(candidate["vocab_size"], block_size, candidate["n_layer"], candidate["n_embd"],
                      candidate["n_head"], candidate["n_head"], 4 * candidate["n_embd"])  # fmt: skip
        return abs(math.log(count_parameters(shape) / parameters))

    return min((fields(*shape) for shape in REFERENCE_SHAPES), key=distance)


# --- activations (Korthikanti et al. 2022) -------------------------------------------------------


def layer_activations(shape: Shape, micro_batch: int, precision: str, tensor_parallel: int = 1) -> float:
    """Bytes one layer of this project's model saves for backward (see the module docstring)."""
    a, r = activation_bytes(precision)
    s, b, h, t = shape.sequence_length, micro_batch, shape.n_embd, tensor_parallel
    tokens = s * b
    norms = 2 * r * tokens * h + 2 * 2 * 4 * tokens  # inputs, plus mean and 1/std in fp32
    # A norm's output is saved once by the linears that read it; under autocast each linear casts the fp32 output
    # itself and saves its own 16-bit copy: q, k and v, then fc (SwiGLU: gate and up).
    normed = (3 + (2 if shape.gated_mlp else 1) if precision in MIXED else 2) * a * tokens * h
    qkv = a * tokens * (h + 2 * shape.kv_width) / t
    attention = a * tokens * h / t + 4 * b * shape.n_head * s / t
    mlp = (4 if shape.gated_mlp else 2) * a * tokens * shape.ffn_hidden / t
    mlp += 2 * a * tokens * shape.experts_per_token * h / t  # a mixture of experts' dispatched rows, their outputs
    weights = 0.0
    if precision in MIXED:  # autocast's low-precision weight copies, saved by each matmul
        split, replicated = layer_linear_parameters(shape)
        weights = 2 * (split / t + replicated)
    return norms + normed + qkv + attention + mlp + weights


def activations(
    shape: Shape,
    micro_batch: int,
    precision: str,
    tensor_parallel: int = 1,
    checkpoint_every: int = 1,
    sixteen_bit_module: bool = False,
) -> Activations:
    """Activation bytes per device per micro-batch: the paper's formula and this project's model. A 16-bit module
    under mixed precision computes its blocks as bf16-true, and autocast still runs the loss in fp32."""
    blocks = "bf16-true" if sixteen_bit_module and precision in MIXED else precision
    a, r = activation_bytes(blocks)
    s, b, h, t, v = shape.sequence_length, micro_batch, shape.n_embd, tensor_parallel, shape.vocab_size
    heads, layers = shape.n_head, shape.n_layer
    tokens = s * b
    paper_layer = tokens * h * (10 + 24 / t + 5 * heads * s / (h * t))
    paper_outside = 4 * tokens * h * (1 + v / h) / t
    layer = layer_activations(shape, micro_batch, blocks, tensor_parallel)
    logits = (2 if precision in HALF_TRUE else 4) * tokens * v  # the log-softmax the loss saves
    outside = 8 * tokens + 8 * s + r * tokens * h + a * tokens * h + 2 * 4 * tokens + logits
    if blocks in MIXED:
        outside += 2 * v * h  # the head's bf16 weight copy
    checkpointed = -(-layers // checkpoint_every)
    return Activations(
        paper=layers * paper_layer + paper_outside,
        paper_checkpointed=layers * 2 * tokens * h + paper_outside,
        held=layers * layer + outside,
        held_checkpointed=checkpointed * r * tokens * h + (layers - checkpointed) * layer + outside,
        recompute_peak=layer,
        # backward begins with the loss's gradient of the log-softmax and of the logits, both logits-sized
        backward_transient=2 * logits,
        output=a * tokens * v,  # the head's output, in the dtype its matmul computes in
    )


# --- FLOPs ---------------------------------------------------------------------------------------


def training_flops_per_token(shape: Shape) -> float:
    """Model FLOPs of forward + backward per token: 6 * matmul parameters + 12 * n_layer * n_embd * s.

    The same count as `models.training_flops_per_token` (attention over the full block, not causal;
    recomputation not counted).
    """
    matmul = shape.n_layer * sum(layer_weight_matrices(shape)) + shape.vocab_size * shape.n_embd
    return 6 * matmul + 12 * shape.n_layer * shape.n_embd * shape.sequence_length


def layer_weight_matrices(shape: Shape) -> tuple[int, ...]:
    """Weight-matrix sizes of one layer (what matmuls multiply by), biases left out."""
    h, kv, ffn = shape.n_embd, shape.kv_width, shape.ffn_hidden
    if shape.experts:  # the router, then the active width's gate, up and down (the experts a token is sent to)
        return (h * h, h * kv, h * kv, h * h, h * shape.experts, h * ffn, h * ffn, ffn * h)
    mlp_in = (h * ffn, h * ffn) if shape.gated_mlp else (h * ffn,)
    return (h * h, h * kv, h * kv, h * h, *mlp_in, ffn * h)
