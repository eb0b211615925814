"""The ViT's Hugging Face layout: ViTForImageClassification's tensor names, its config.json, and the
preprocessor_config.json of ViTImageProcessor that prepares pixels as training does.

Every tensor maps one to one (same shape, no transpose). The names are those transformers' save_pretrained
writes (`vit.encoder.layer.N.attention.attention.query`, ...), which every transformers version loads.

No torch: recipes are checked before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ViTConfig

ARCHITECTURE = "ViTForImageClassification"
CONFIG = "config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# Training feeds pixels / 255 normalised as (x - 0.5) / 0.5 in every channel, i.e. into [-1, 1].
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face layout: the model's parameter it is a copy of, and its shape."""

    source: str
    shape: tuple[int, ...]


def hf_tensors(config: ViTConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> the ViT parameter it holds."""
    width, hidden = config.n_embd, config.mlp_hidden_size
    tensors = {
        "vit.embeddings.cls_token": HFTensor("embedding.class_token", (1, 1, width)),
        "vit.embeddings.position_embeddings": HFTensor("embedding.positions", (1, config.sequence_length, width)),
        "vit.embeddings.patch_embeddings.projection.weight": HFTensor(
            "embedding.projection.weight", (width, config.channels, config.patch_size, config.patch_size)
        ),
        "vit.embeddings.patch_embeddings.projection.bias": HFTensor("embedding.projection.bias", (width,)),
    }
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"vit.encoder.layer.{i}."
        layers = {  # Hugging Face's module -> ours, its weight's shape (a LayerNorm's: None, i.e. (width,))
            "layernorm_before": ("norm_attn", None),
            "attention.attention.query": ("attn.q", (width, width)),
            "attention.attention.key": ("attn.k", (width, width)),
            "attention.attention.value": ("attn.v", (width, width)),
            "attention.output.dense": ("attn.proj", (width, width)),
            "layernorm_after": ("norm_mlp", None),
            "intermediate.dense": ("mlp.fc", (hidden, width)),
            "output.dense": ("mlp.proj", (width, hidden)),
        }
        for their_layer, (our_layer, shape) in layers.items():
            weight_shape = shape or (width,)
            bias_shape = weight_shape[:1]  # one per output feature
            tensors[f"{theirs}{their_layer}.weight"] = HFTensor(f"{ours}{our_layer}.weight", weight_shape)
            tensors[f"{theirs}{their_layer}.bias"] = HFTensor(f"{ours}{our_layer}.bias", bias_shape)
    tensors["vit.layernorm.weight"] = HFTensor("norm.weight", (width,))
    tensors["vit.layernorm.bias"] = HFTensor("norm.bias", (width,))
    tensors["classifier.weight"] = HFTensor("head.weight", (config.num_classes, width))
    tensors["classifier.bias"] = HFTensor("head.bias", (config.num_classes,))
    return tensors


def hf_config(config: ViTConfig, dtype: str, labels: list[str]) -> dict[str, Any]:
    """ViTForImageClassification's config.json (weights of `dtype`, e.g. float32; class i is named labels[i])."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "vit",
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "intermediate_size": config.mlp_hidden_size,
        "hidden_act": "gelu",  # exact GELU, as the ViT's MLP
        "layer_norm_eps": config.norm_eps,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "num_channels": config.channels,
        "qkv_bias": True,
        # Hugging Face's hidden dropout acts where the ViT's does (embeddings, MLP output) and also after attention;
        # neither drops attention weights. Neither changes outputs in eval mode.
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "id2label": {str(index): label for index, label in enumerate(labels)},
        "label2id": {label: index for index, label in enumerate(labels)},
        "dtype": dtype,  # transformers 5
        "torch_dtype": dtype,  # transformers 4
    }


def preprocessor_config(config: ViTConfig) -> dict[str, Any]:
    """ViTImageProcessor's preprocessor_config.json: resize to image_size, pixels / 255, then (x - 0.5) / 0.5."""
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": config.image_size, "width": config.image_size},
        "resample": 2,  # PIL's bilinear
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [PIXEL_MEAN] * config.channels,
        "image_std": [PIXEL_STD] * config.channels,
    }
