"""The Llama's Hugging Face layout: LlamaForCausalLM, one to one (the same rotate-half RoPE convention, so no
permutation of q and k).

No torch: `recipes validate` and init_from checks read it before any process starts.
"""

from __future__ import annotations

from typing import Any

from .....recipe.schema import field_path
from ...config import ModelConfig
from ...hf import LLAMA, HFTensor


def tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> how it is made from the model's state dict (a tied head is not listed)."""
    width, hidden, kv_width = config.n_embd, config.mlp_hidden_size, config.kv_heads * (config.n_embd // config.n_head)
    tensors = {"model.embed_tokens.weight": HFTensor(("token_embedding.weight",), (config.vocab_size, width))}
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, hf_name, shape in (
            ("norm_attn.weight", "input_layernorm.weight", (width,)),
            ("attn.q.weight", "self_attn.q_proj.weight", (width, width)),
            ("attn.k.weight", "self_attn.k_proj.weight", (kv_width, width)),
            ("attn.v.weight", "self_attn.v_proj.weight", (kv_width, width)),
            ("attn.o.weight", "self_attn.o_proj.weight", (width, width)),
            ("norm_mlp.weight", "post_attention_layernorm.weight", (width,)),
            ("mlp.gate.weight", "mlp.gate_proj.weight", (hidden, width)),
            ("mlp.up.weight", "mlp.up_proj.weight", (hidden, width)),
            ("mlp.down.weight", "mlp.down_proj.weight", (width, hidden)),
        ):
            tensors[theirs + hf_name] = HFTensor((ours + name,), shape)
    tensors["model.norm.weight"] = HFTensor(("norm.weight",), (width,))
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = HFTensor(("lm_head.weight",), (config.vocab_size, width))
    return tensors


def export_problem(config: ModelConfig) -> str | None:
    """None for a dense Llama, which maps onto LlamaForCausalLM exactly; a mixture of experts has no mapping yet."""
    if config.moe.num_experts:
        return f"model.moe.num_experts={config.moe.num_experts}: a mixture of experts has no Hugging Face layout here"
    return None


def config(config: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """LlamaForCausalLM's config.json (weights of `dtype`)."""
    return {
        "architectures": [LLAMA],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_hidden_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.n_embd // config.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
    }


def expected_config(model: ModelConfig) -> dict[str, tuple[str, Any]]:
    """config.json key -> (the recipe field it must equal, its value) for an init_from folder."""
    n_embd, n_head = field_path(model, "n_embd"), field_path(model, "n_head")
    return {
        "hidden_size": (n_embd, model.n_embd),
        "num_hidden_layers": (field_path(model, "n_layer"), model.n_layer),
        "num_attention_heads": (n_head, model.n_head),
        "num_key_value_heads": (field_path(model, "n_kv_head"), model.kv_heads),
        "intermediate_size": (field_path(model, "intermediate_size"), model.mlp_hidden_size),
        "vocab_size": (field_path(model, "vocab_size"), model.vocab_size),
        "rope_theta": (field_path(model, "rope_theta"), model.rope_theta),
        "tie_word_embeddings": (field_path(model, "tie_embeddings"), model.tie_embeddings),
        "rms_norm_eps": (field_path(model, "norm_eps"), model.norm_eps),
        "head_dim": (f"{n_embd} / {n_head}", model.n_embd // model.n_head),
    }
