"""A ViT checkpoint as a Hugging Face model folder: `transformers.ViTForImageClassification.from_pretrained(OUT_DIR)`
loads it, and `ViTImageProcessor.from_pretrained(OUT_DIR)` prepares images as training did.

It writes config.json (with the class names), preprocessor_config.json and the weights as safetensors (split into
files of at most `max_shard_bytes`, with an index, when larger). The checkpoint is read one tensor at a time on CPU,
so no more than one output file's tensors are held at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.layout import checkpoint_recipe, new_partial, removed_unless_finished
from ...checkpoint.tensors import checkpoint_tensor_reader, write_safetensors
from ...errors import RecipeError
from ...progress import counted
from .config import ViTConfig
from .hf import (
    ARCHITECTURE,
    CONFIG,
    PREPROCESSOR_CONFIG,
    hf_config,
    hf_tensors,
    preprocessor_config,
)


def hf_weights(
    config: ViTConfig, names: set[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the layout, read from the checkpoint one at a time."""
    for hf_name, spec in hf_tensors(config).items():
        if spec.source not in names:
            raise RecipeError(f"the checkpoint has no {spec.source} (was it saved by the ViT?)")
        yield hf_name, read(spec.source).contiguous()


def export_hf(path: Path, out_dir: Path, max_shard_bytes: int, labels: list[str]) -> dict[str, Any]:
    """Write a complete ViT checkpoint folder as a Hugging Face model folder (to OUT.partial, renamed when done);
    class i is named labels[i] in config.json."""
    config: ViTConfig = checkpoint_recipe(path).model
    if len(labels) != config.num_classes or len(set(labels)) != len(labels):
        raise RecipeError(
            f"{len(labels)} class names ({len(set(labels))} distinct) for a model of model.num_classes="
            f"{config.num_classes}: give one distinct name per class"
        )
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RecipeError(f"{out_dir} exists and is not empty: choose a new folder")
    if max_shard_bytes < 1:
        raise RecipeError(f"--max_shard_bytes={max_shard_bytes} must be >= 1")
    names, read = checkpoint_tensor_reader(path)
    with removed_unless_finished(new_partial(out_dir)) as partial:
        weights = counted(hf_weights(config, names, read), f"Exporting {path}", len(hf_tensors(config)), "tensors")
        written = write_safetensors(weights, partial, max_shard_bytes)
        (partial / CONFIG).write_text(json.dumps(hf_config(config, written["dtype"], labels), indent=2) + "\n")
        (partial / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor_config(config), indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        partial.rename(out_dir)
    return {**written, "architecture": ARCHITECTURE}
