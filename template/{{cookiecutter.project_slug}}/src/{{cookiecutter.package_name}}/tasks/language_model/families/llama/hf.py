"""The Llama's Hugging Face layout: LlamaForCausalLM, one to one (the same rotate-half RoPE convention, so no
permutation of q and k); a mixture of experts (model.moe) as MixtralForCausalLM, whose attention is the Llama's and
whose sparse block is a softmax router over SwiGLU experts with normalised top-k weights. (Qwen3-MoE's attention
normalises q and k per head, which this model does not: Mixtral is the layout that holds it exactly.) Each expert
is its own tensor there (experts.<j>.w1/w3/w2: gate, up, down), a slice of the model's stacked expert weights.

No torch: `recipes validate` and init_from checks read it before any process starts.
"""

from __future__ import annotations

from typing import Any

from .....recipe.schema import field_path
from ...config import ModelConfig
from ...hf import LLAMA, MIXTRAL, HFTensor


def tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> how it is made from the model's state dict (a tied head is not listed)."""
    width, hidden, kv_width = config.n_embd, config.mlp_hidden_size, config.kv_heads * (config.n_embd // config.n_head)
    tensors = {"model.embed_tokens.weight": HFTensor(("token_embedding.weight",), (config.vocab_size, width))}
    dense_mlp = [  # a mixture of experts has its own tensors instead (expert_tensors)
        ("mlp.gate.weight", "mlp.gate_proj.weight", (hidden, width)),
        ("mlp.up.weight", "mlp.up_proj.weight", (hidden, width)),
        ("mlp.down.weight", "mlp.down_proj.weight", (width, hidden)),
    ]
    if config.moe.num_experts:
        dense_mlp.clear()
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, hf_name, shape in (
            ("norm_attn.weight", "input_layernorm.weight", (width,)),
            ("attn.q.weight", "self_attn.q_proj.weight", (width, width)),
            ("attn.k.weight", "self_attn.k_proj.weight", (kv_width, width)),
            ("attn.v.weight", "self_attn.v_proj.weight", (kv_width, width)),
            ("attn.o.weight", "self_attn.o_proj.weight", (width, width)),
            ("norm_mlp.weight", "post_attention_layernorm.weight", (width,)),
            *dense_mlp,
        ):
            tensors[theirs + hf_name] = HFTensor((ours + name,), shape)
        if config.moe.num_experts:
            tensors |= expert_tensors(config, ours, theirs)
    tensors["model.norm.weight"] = HFTensor(("norm.weight",), (width,))
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = HFTensor(("lm_head.weight",), (config.vocab_size, width))
    return tensors


def expert_tensors(config: ModelConfig, ours: str, theirs: str) -> dict[str, HFTensor]:
    """One block's mixture of experts in Mixtral's layout: the router, then each expert's three matrices."""
    width, hidden = config.n_embd, config.expert_hidden_size
    moe = theirs + "block_sparse_moe."
    tensors = {moe + "gate.weight": HFTensor((ours + "mlp.router.weight",), (config.moe.num_experts, width))}
    for expert in range(config.moe.num_experts):
        for name, hf_name, shape in (
            ("gate", "w1", (hidden, width)),
            ("up", "w3", (hidden, width)),
            ("down", "w2", (width, hidden)),
        ):
            tensors[f"{moe}experts.{expert}.{hf_name}.weight"] = HFTensor(
                (f"{ours}mlp.experts.{name}",), shape, expert=expert
            )
    return tensors


def export_problem(config: ModelConfig) -> str | None:
    """None for a dense Llama (LlamaForCausalLM) and for a mixture of experts that Mixtral computes the same: a
    softmax router whose top-k weights are normalised, dropless, with no shared experts and no routing bias."""
    moe = config.moe
    if not moe.num_experts:
        return None
    mixtral = {
        "gate": (moe.gate, "softmax"),
        "normalize_top_k": (moe.normalize_top_k, True),
        "shared_experts": (moe.shared_experts, 0),
        "capacity_factor": (moe.capacity_factor, None),
    }
    for name, (value, supported) in mixtral.items():
        if value != supported:
            return f"{field_path(moe, name)}={value}: Hugging Face's {MIXTRAL} has {supported} only"
    if moe.load_balance == "bias":
        return f"{field_path(moe, 'load_balance')}=bias: the routing bias has no place in Hugging Face's {MIXTRAL}"
    return None


def architecture(config: ModelConfig) -> tuple[str, str]:
    """(model_type, architecture) of the Hugging Face layout: Mixtral for a mixture of experts, else Llama."""
    return ("mixtral", MIXTRAL) if config.moe.num_experts else ("llama", LLAMA)


def config(config: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """LlamaForCausalLM's config.json, or MixtralForCausalLM's for a mixture of experts (weights of `dtype`)."""
    model_type, arch = architecture(config)
    common = {
        "architectures": [arch],
        "model_type": model_type,
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
    if not config.moe.num_experts:
        return common
    return common | {
        "intermediate_size": config.expert_hidden_size,
        "num_local_experts": config.moe.num_experts,
        "num_experts_per_tok": config.moe.top_k,
        "sliding_window": None,
        "router_aux_loss_coef": config.moe.aux_loss_weight,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def expected_config(model: ModelConfig) -> dict[str, tuple[str, Any]]:
    """config.json key -> (the recipe field it must equal, its value) for an init_from folder."""
    n_embd, n_head = field_path(model, "n_embd"), field_path(model, "n_head")
    expected = {
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
    if not model.moe.num_experts:
        return expected
    moe = model.moe
    return expected | {
        "intermediate_size": (field_path(moe, "expert_intermediate_size"), model.expert_hidden_size),
        "num_local_experts": (field_path(moe, "num_experts"), moe.num_experts),
        "num_experts_per_tok": (field_path(moe, "top_k"), moe.top_k),
    }
