"""The GPT's shape for the size formulas of ../../sizing.py (parameters, activations, FLOPs; no torch)."""

from __future__ import annotations

from typing import Any

from ...sizing import Shape, count_parameters


def shape(model: Any) -> Shape:
    """The shape of this project's GPT for a `ModelConfig` (attributes vocab_size, block_size, ...)."""
    return Shape(
        vocab_size=model.vocab_size,
        sequence_length=model.block_size,
        n_layer=model.n_layer,
        n_embd=model.n_embd,
        n_head=model.n_head,
        n_kv_head=model.n_head,
        ffn_hidden=model.mlp_ratio * model.n_embd,
        bias=model.bias,
        norm_has_bias=model.bias,
    )


def gpt_parameters(model: Any) -> int:
    """Parameters of this project's GPT for a `ModelConfig`: equals `families.count_parameters`, without torch."""
    return count_parameters(shape(model))
