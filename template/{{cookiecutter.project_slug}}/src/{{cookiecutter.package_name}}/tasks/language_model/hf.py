"""The Hugging Face layout of the model families: config.json fields and tensor names, both ways.

A Llama maps one to one onto transformers' LlamaForCausalLM (the same rotate-half RoPE convention, so
no permutation of q and k). The GPT maps onto GPT2LMHeadModel only when it has GPT-2's biases; GPT-2
keeps q, k and v in one Conv1D (`c_attn`), whose weights are the transpose of a Linear's.

Importing this module does not import torch: `check_init_from` reads config.json and the safetensors
headers (JSON) when a recipe is checked, before any process starts. `pretrained_tensors` reads the
weights themselves (torch, safetensors) in a training process.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
LLAMA = "LlamaForCausalLM"


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face layout: the project's tensors it is made of (concatenated along dim 0),
    whether it is their transpose (GPT-2's Conv1D), and its shape."""

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False


def hf_tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> how it is made from the project model's state dict (a tied head is not listed)."""
    return _llama_tensors(config) if config.arch == "llama" else _gpt2_tensors(config)


def _llama_tensors(config: ModelConfig) -> dict[str, HFTensor]:
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


def _gpt2_tensors(config: ModelConfig) -> dict[str, HFTensor]:
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
    if config.arch == "gpt" and not config.bias:
        return (
            "GPT-2's layout (GPT2LMHeadModel) has a bias in every linear and LayerNorm layer and this model was"
            " trained with model.bias=false, so it does not map onto it exactly"
        )
    return None


def hf_config(config: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of the model in the Hugging Face layout (weights of `dtype`, e.g. float32)."""
    if config.arch == "llama":
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


def _expected_config(model: ModelConfig) -> dict[str, tuple[str, Any]]:
    """config.json key -> (the recipe field it must equal, its value) for an init_from folder."""
    return {
        "hidden_size": ("model.n_embd", model.n_embd),
        "num_hidden_layers": ("model.n_layer", model.n_layer),
        "num_attention_heads": ("model.n_head", model.n_head),
        "num_key_value_heads": ("model.n_kv_head", model.kv_heads),
        "intermediate_size": ("model.intermediate_size", model.mlp_hidden_size),
        "vocab_size": ("model.vocab_size", model.vocab_size),
        "rope_theta": ("model.rope_theta", model.rope_theta),
        "tie_word_embeddings": ("model.tie_embeddings", model.tie_embeddings),
        "rms_norm_eps": ("model.norm_eps", model.norm_eps),
        "head_dim": ("model.n_embd / model.n_head", model.n_embd // model.n_head),
    }


def read_hf_config(folder: Path) -> dict[str, Any]:
    """A Hugging Face folder's config.json, with the defaults transformers' LlamaConfig fills in."""
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise RecipeError(
            f"{folder}: no {CONFIG} (a Hugging Face model folder has config.json and *.safetensors)"
        ) from None
    except (OSError, ValueError) as error:
        raise RecipeError(f"{folder / CONFIG}: unreadable ({error})") from None
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    config.setdefault("tie_word_embeddings", False)
    config.setdefault("rms_norm_eps", 1e-6)
    if config.get("hidden_size") and config.get("num_attention_heads"):
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder (one model.safetensors, or the shards its index names)."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise RecipeError(f"{folder}: no {SINGLE_FILE} or {INDEX} (weights in safetensors format)")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (8-byte length, then JSON), without torch."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_init_from(model: ModelConfig) -> None:
    """Refuse an init_from folder that is not a Llama of exactly the recipe's shape (config.json and tensors)."""
    where = f"model.init_from={model.init_from!r}"
    folder = Path(str(model.init_from))
    if not folder.is_dir():
        raise RecipeError(f"{where}: no such folder (a local Hugging Face Llama folder: config.json + safetensors)")
    try:
        config = read_hf_config(folder)
        files = safetensors_files(folder)
        shapes = {name: shape for file in files for name, shape in safetensors_shapes(file).items()}
    except RecipeError as error:
        raise RecipeError(f"{where}: {error}") from None
    except (OSError, ValueError, KeyError, struct.error) as error:
        raise RecipeError(f"{where}: unreadable weights ({error})") from None
    architectures = config.get("architectures") or [config.get("model_type")]
    if config.get("model_type") != "llama" and LLAMA not in architectures:
        raise RecipeError(f"{where} holds a {'/'.join(map(str, architectures))} model; init_from reads {LLAMA} folders")
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "rope type": (config["rope_type"], "default"),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise RecipeError(f"{where}: {key}={value} in {CONFIG}; the llama model supports {supported} only")
    mismatches = [
        f"{key}={config.get(key)} but {field}={value}"
        for key, (field, value) in _expected_config(model).items()
        if config.get(key) != value
    ]
    if mismatches:
        raise RecipeError(f"{where} does not match the recipe's model: {'; '.join(mismatches)} in {CONFIG}")
    expected = {name: tensor.shape for name, tensor in hf_tensors(model).items()}
    if model.tie_embeddings:  # some tied checkpoints store the head as well
        shapes.pop("lm_head.weight", None)
    for name, shape in expected.items():
        if name not in shapes:
            raise RecipeError(f"{where}: the weights have no tensor {name}")
        if shapes[name] != shape:
            raise RecipeError(f"{where}: {name} has shape {list(shapes[name])}, the recipe's model needs {list(shape)}")
    if extra := sorted(set(shapes) - set(expected)):
        raise RecipeError(f"{where}: the weights have tensors the model does not ({', '.join(extra[:3])})")


def pretrained_tensors(model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(project name, tensor) for every parameter of the init_from folder, read one at a time (a tied head is
    given under both names)."""
    from safetensors import safe_open

    folder = Path(str(model.init_from))
    location: dict[str, Path] = {}
    for file in safetensors_files(folder):
        location |= dict.fromkeys(safetensors_shapes(file), file)
    for hf_name, tensor in hf_tensors(model).items():
        with safe_open(location[hf_name], framework="pt") as weights:
            value = weights.get_tensor(hf_name)
        (name,) = tensor.sources
        yield name, value
        if model.tie_embeddings and name == "token_embedding.weight":
            yield "lm_head.weight", value
