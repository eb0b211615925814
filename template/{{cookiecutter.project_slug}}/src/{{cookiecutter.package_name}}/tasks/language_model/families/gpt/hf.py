"""The GPT's Hugging Face layout: GPT2LMHeadModel, when the model has GPT-2's biases. GPT-2 keeps q, k and v in one
Conv1D (`c_attn`), whose weights are the transpose of a Linear's.

No torch: `recipes validate` and init_from checks read it before any process starts.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ...hf import HFTensor


def tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> how it is made from the model's state dict."""
    width, hidden = config.n_embd, config.mlp_hidden_size
    tensors = {
        "transformer.wte.weight": HFTensor(("token_embedding.weight",), (config.vocab_size, width)),
        "transformer.wpe.weight": HFTensor(("position_embedding.weight",), (config.block_size, width)),
    }
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = tuple(f"{ours}attn.{name}" for name in "qkv")
        tensors |= {
            theirs + "ln_1.weight": HFTensor((ours + "norm_attn.weight",), (width,)),
            theirs + "ln_1.bias": HFTensor((ours + "norm_attn.bias",), (width,)),
            theirs + "attn.c_attn.weight": HFTensor(tuple(f"{n}.weight" for n in qkv), (width, 3 * width), True),
            theirs + "attn.c_attn.bias": HFTensor(tuple(f"{n}.bias" for n in qkv), (3 * width,)),
            theirs + "attn.c_proj.weight": HFTensor((ours + "attn.proj.weight",), (width, width), True),
            theirs + "attn.c_proj.bias": HFTensor((ours + "attn.proj.bias",), (width,)),
            theirs + "ln_2.weight": HFTensor((ours + "norm_mlp.weight",), (width,)),
            theirs + "ln_2.bias": HFTensor((ours + "norm_mlp.bias",), (width,)),
            theirs + "mlp.c_fc.weight": HFTensor((ours + "mlp.fc.weight",), (width, hidden), True),
            theirs + "mlp.c_fc.bias": HFTensor((ours + "mlp.fc.bias",), (hidden,)),
            theirs + "mlp.c_proj.weight": HFTensor((ours + "mlp.proj.weight",), (hidden, width), True),
            theirs + "mlp.c_proj.bias": HFTensor((ours + "mlp.proj.bias",), (width,)),
        }
    tensors["transformer.ln_f.weight"] = HFTensor(("norm.weight",), (width,))
    tensors["transformer.ln_f.bias"] = HFTensor(("norm.bias",), (width,))
    tensors["lm_head.weight"] = HFTensor(("lm_head.weight",), (config.vocab_size, width))
    return tensors


def export_problem(config: ModelConfig) -> str | None:
    """Why the model cannot be written in a Hugging Face layout with the same outputs, or None."""
    if not config.bias:
        return (
            "GPT-2's layout (GPT2LMHeadModel) has a bias in every linear and LayerNorm layer and this model was"
            " trained with model.bias=false, so it does not map onto it exactly"
        )
    return None


def config(config: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """GPT2LMHeadModel's config.json (weights of `dtype`)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.mlp_hidden_size,
        "activation_function": "gelu_new",  # GELU with the tanh approximation, as the GPT's MLP
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
    }
