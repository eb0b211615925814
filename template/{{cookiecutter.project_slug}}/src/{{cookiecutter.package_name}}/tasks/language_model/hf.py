"""The Hugging Face round trip of the language model: each family's layout (families/<arch>/hf.py: config.json
fields and tensor names) and what every family shares: safetensors headers, init_from checks, reading weights.

Importing this module does not import torch: `check_init_from` reads config.json and the safetensors
headers (JSON) when a recipe is checked, before any process starts. `pretrained_tensors` reads the
weights themselves (torch, safetensors) in a training process.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...checkpoint.layout import INDEX, SINGLE_FILE
from ...errors import RecipeError
from .config import ModelConfig
from .families import family_part

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face layout: the project's tensors it is made of (concatenated along dim 0),
    whether it is their transpose (GPT-2's Conv1D), its shape, and, for one expert of stacked expert weights
    ([expert, out, in]), which expert's slice it is."""

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    expert: int | None = None


def hf_tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Hugging Face name -> how it is made from the project model's state dict (a tied head is not listed)."""
    return family_part(config.arch, "hf").tensors(config)


def export_problem(config: ModelConfig) -> str | None:
    """Why the model cannot be written in a Hugging Face layout with the same outputs, or None."""
    return family_part(config.arch, "hf").export_problem(config)


def hf_config(config: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of the model in the Hugging Face layout (weights of `dtype`, e.g. float32)."""
    return family_part(config.arch, "hf").config(config, dtype, eos_token_id)


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
    if config.get("head_dim") is None and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]  # Mixtral writes null
    config["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder (one model.safetensors, or the shards its index names, each a file
    of the folder: a name that leads elsewhere, by `..`, an absolute path or a link, is refused)."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise RecipeError(f"{folder / INDEX}: weight_map must map tensor names to file names")
        inside = folder.resolve()
        # A Hugging Face cache's snapshot (models--X/snapshots/REV) holds links into its own models--X/blobs.
        roots = [inside, *([inside.parents[1] / "blobs"] if inside.parent.name == "snapshots" else [])]
        files = []
        for name in sorted(set(weight_map.values())):
            path = (folder / name).resolve()
            lexical = Path(name).is_absolute() or ".." in Path(name).parts
            if lexical or path == inside or not any(path.is_relative_to(root) for root in roots):
                raise RecipeError(f"{folder / INDEX}: weight_map names {name[:100]!r}, outside the folder (refused)")
            files.append(folder / name)
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise RecipeError(f"{folder}: no {SINGLE_FILE} or {INDEX} (weights in safetensors format)")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (8-byte length, then JSON), without torch; a header
    length beyond the file's size is refused before anything that size is read."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > path.stat().st_size - 8:
            raise RecipeError(
                f"{path}: its header claims {length:,} bytes, more than the file's {path.stat().st_size:,}"
                " (not a safetensors file, or cut short)"
            )
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise RecipeError(f"{path}: its header is not a JSON object (not a safetensors file)")
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_init_from(model: ModelConfig) -> None:
    """Refuse an init_from folder that is not a Llama (a Mixtral for a mixture of experts) of exactly the recipe's
    shape (config.json and tensors)."""
    where = f"model.init_from={model.init_from!r}"
    model_type, arch = family_part("llama", "hf").architecture(model)
    if problem := export_problem(model):
        raise RecipeError(f"{where}: {problem} (init_from reads {arch} folders)")
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
    if config.get("model_type") != model_type and arch not in architectures:
        raise RecipeError(
            f"{where} holds a {'/'.join(map(str, architectures))} model; init_from reads {arch} folders for this model"
        )
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "rope type": (config["rope_type"], "default"),
        "sliding_window": (config.get("sliding_window"), None),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise RecipeError(f"{where}: {key}={value} in {CONFIG}; the llama model supports {supported} only")
    mismatches = [
        f"{key}={config.get(key)} but {field}={value}"
        for key, (field, value) in family_part("llama", "hf").expected_config(model).items()
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


def pretrained_reader(model: ModelConfig) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(project names, a reader of one of them) of the init_from folder's parameters: each read opens the files
    that hold it (a tied head is not listed: it is the embedding); stacked expert weights are read expert by
    expert, in order, and stacked."""
    import torch
    from safetensors import safe_open

    folder = Path(str(model.init_from))
    location: dict[str, Path] = {}
    for file in safetensors_files(folder):
        location |= dict.fromkeys(safetensors_shapes(file), file)
    hf_names: dict[str, list[str]] = {}  # the Llama's map one to one; an expert weight has one per expert
    for name, tensor in hf_tensors(model).items():
        hf_names.setdefault(tensor.sources[0], []).append(name)

    def read_one(hf_name: str) -> torch.Tensor:
        with safe_open(location[hf_name], framework="pt") as weights:
            return weights.get_tensor(hf_name)

    def read(name: str) -> torch.Tensor:
        parts = hf_names[name]
        return read_one(parts[0]) if len(parts) == 1 else torch.stack([read_one(part) for part in parts])

    return set(hf_names), read


def pretrained_tensors(model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(project name, tensor) for every parameter of the init_from folder, read one at a time (a tied head is
    given under both names)."""
    _, read = pretrained_reader(model)
    for name in dict.fromkeys(tensor.sources[0] for tensor in hf_tensors(model).values()):
        value = read(name)
        yield name, value
        if model.tie_embeddings and name == "token_embedding.weight":
            yield "lm_head.weight", value
