"""The Llama's shape for the size formulas of ../../sizing.py (parameters, activations, FLOPs; no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...sizing import Shape, count_parameters


def shape(model: Any) -> Shape:
    """The shape of the Llama a `ModelConfig` describes; a mixture of experts' MLP counted as its active width."""
    moe = model.moe
    if moe.num_experts:
        expert, shared = model.expert_hidden_size, moe.shared_experts * model.expert_hidden_size
        dense = shape(replace(model, intermediate_size=moe.top_k * expert + shared, moe=type(moe)()))
        return replace(
            dense, experts=moe.num_experts, experts_per_token=moe.top_k, expert_hidden=expert, shared_hidden=shared
        )
    return llama_shape(
        {
            "vocab_size": model.vocab_size,
            "block_size": model.block_size,
            "n_layer": model.n_layer,
            "n_embd": model.n_embd,
            "n_head": model.n_head,
            "n_kv_head": model.kv_heads,
            "intermediate_size": model.mlp_hidden_size,
            "tie_embeddings": model.tie_embeddings,
        }
    )


def llama_shape(config: Mapping[str, Any]) -> Shape:
    """The shape of a Llama-style decoder: RMSNorm, SwiGLU, grouped-query attention, rotary positions, no biases.

    `config` holds vocab_size, block_size, n_layer, n_embd, n_head, n_kv_head, intermediate_size and
    optionally tie_embeddings (default false).
    """
    return Shape(
        vocab_size=config["vocab_size"],
        sequence_length=config["block_size"],
        n_layer=config["n_layer"],
        n_embd=config["n_embd"],
        n_head=config["n_head"],
        n_kv_head=config["n_kv_head"],
        ffn_hidden=config["intermediate_size"],
        gated_mlp=True,
        learned_positions=False,
        tied_embeddings=config.get("tie_embeddings", False),
    )


def llama_parameters(config: Mapping[str, Any]) -> int:
    """Parameters of a Llama-style decoder described by a config dict (see `llama_shape`)."""
    return count_parameters(llama_shape(config))
