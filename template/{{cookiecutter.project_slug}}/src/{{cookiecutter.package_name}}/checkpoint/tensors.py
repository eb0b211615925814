"""A checkpoint's model tensors, read one at a time, and a model's weights written as safetensors files.

What every task's `export` and `sample`/`predict` share: the trained model of a checkpoint folder, built by
its task from the checkpoint's own recipe; a reader of single tensors that never loads the whole checkpoint
(torch.distributed.checkpoint without a process group for sharded layouts, a memory map for whole ones);
and the writer of Hugging Face's weight files (one file, or several plus an index).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import RecipeError
from ..recipe.registry import STRATEGIES, task_for
from ..recipe.schema import Recipe
from .layout import INDEX, SINGLE_FILE, checkpoint_recipe, read_meta
from .safety import check_metadata, load_tensors

DEFAULT_SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained writes per file by default
# Module wrappers that activation checkpointing and torch.compile can leave in parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def load_model(path: Path) -> tuple[torch.nn.Module, Recipe]:
    """The trained model of a checkpoint folder, in eval mode on CPU, and the recipe it was trained with.

    Only the model's tensors are read (`model_tensors`): not the optimizer state, which is about twice their size.
    A checkpoint of a run whose base was frozen (adapters) holds only what trained: the base comes from the
    task's pretrained weights, as in training.
    """
    recipe = checkpoint_recipe(path)
    task = task_for(recipe)
    model = task.build_model()
    weights = model_tensors(path)
    if task.frozen_from_pretrained():
        weights = dict(task.pretrained_tensors()) | weights
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = sorted(name for name in expected.keys() & weights.keys() if expected[name].shape != weights[name].shape)
    if missing or unexpected or wrong:
        first = (
            (missing and f"no {missing[0]}")
            or (unexpected and f"an unknown {unexpected[0]}")
            or f"{wrong[0]} of another shape"
        )
        raise RecipeError(
            f"checkpoint {path} does not fit the model its config.yaml describes ({first}; {len(missing)} missing,"
            f" {len(unexpected)} unknown, {len(wrong)} of another shape): saved by another version of the model code?"
        )
    model.load_state_dict(weights)
    return model.eval(), recipe


def trained_part(model: torch.nn.Module) -> torch.nn.Module:
    """The model's trained parameters (requires_grad) as a module of their own, under their names in the model's
    state dict: what a checkpoint holds when the rest of the model is frozen (adapters on a pretrained base).

    It shares the parameters themselves (sharded ones too), so saving and loading it through Fabric reads and
    writes the model's, and the optimizer's state maps onto its names as onto the model's.
    """
    part = torch.nn.Module()
    for name, value in model.state_dict(keep_vars=True).items():
        if not (isinstance(value, torch.nn.Parameter) and value.requires_grad):
            continue
        *path, leaf = name.split(".")
        owner = part
        for step in path:
            if step not in owner._modules:
                owner.add_module(step, torch.nn.Module())
            owner = owner._modules[step]  # type: ignore[assignment]  # just added: never None
        owner.register_parameter(leaf, value)
    return part


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint folder, and nothing else of it: a sharded checkpoint is asked for the
    `model.*` entries only; a whole one is opened by memory map, so the optimizer state is never read from disk."""
    layout = STRATEGIES(read_meta(path, needs=("strategy",))["strategy"]).checkpoint_layout
    state = path / "state"
    if layout == "sharded":
        metadata, keys = _sharded_model_entries(state)
        tensors = {key: _empty_like_entry(metadata[key]) for key in keys.values()}
        _load_sharded(state, tensors)
        return {name: tensors[key] for name, key in keys.items()}
    names, read = checkpoint_tensor_reader(path)
    return {name: read(name) for name in names}


def checkpoint_tensor_reader(path: Path) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(the model's parameter names, a function reading one of them) of a checkpoint folder, without loading it all."""
    layout = STRATEGIES(read_meta(path, needs=("strategy",))["strategy"]).checkpoint_layout
    state = path / "state"
    if layout == "sharded":
        metadata, keys = _sharded_model_entries(state)

        def read_sharded(name: str) -> torch.Tensor:
            tensor = _empty_like_entry(metadata[keys[name]])
            _load_sharded(state, {keys[name]: tensor})
            return tensor

        return set(keys), read_sharded
    if layout == "replicated":
        weights = {_clean(key): value for key, value in _memory_mapped(state)["model"].items()}
        return set(weights), weights.__getitem__
    raise RecipeError(
        f"checkpoint {path}: saved by strategy {read_meta(path)['strategy']} in its own layout; export, sample and"
        " predict read whole (torch.save) and torch.distributed.checkpoint layouts"
    )


def _sharded_model_entries(state: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(torch.distributed.checkpoint's metadata of every entry, the model's parameter name -> its entry's key)."""
    from torch.distributed.checkpoint import FileSystemReader

    check_metadata(state)  # before torch's reader unpickles it
    metadata = FileSystemReader(state).read_metadata().state_dict_metadata
    return metadata, {_clean(key.removeprefix("model.")): key for key in metadata if key.startswith("model.")}


def _empty_like_entry(entry: Any) -> torch.Tensor:
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def _load_sharded(state: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (checkpoint key -> a tensor of its shape) from a sharded checkpoint: only these are read."""
    from torch.distributed.checkpoint import FileSystemReader, load

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(tensors, storage_reader=FileSystemReader(state), no_dist=True)


def _memory_mapped(state: Path) -> dict[str, Any]:
    """A torch.save file opened by memory map: tensors are read from disk when used."""
    return load_tensors(state, map_location="cpu", mmap=True)


def _clean(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def write_safetensors(
    weights: Iterator[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int
) -> dict[str, Any]:
    """Write the tensors into files of at most max_shard_bytes (one file if they fit); return dtype and counts."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes, weight_map, dtype, total = [0], {}, "float32", 0
    files: list[Path] = []

    def flush() -> None:
        files.append(folder / f"part-{len(files):05d}.safetensors")
        save_file(shards[-1], files[-1], metadata={"format": "pt"})

    for name, tensor in weights:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + size > max_shard_bytes:
            flush()
            shards[-1], sizes[-1] = {}, 0  # only the file being filled is kept in memory
        shards[-1][name], sizes[-1] = tensor, sizes[-1] + size
        weight_map[name], total = len(files), total + size
        dtype = str(tensor.dtype).removeprefix("torch.")
    flush()
    count = len(files)
    if count == 1:
        files[0].rename(folder / SINGLE_FILE)
    else:
        names = [f"model-{index + 1:05d}-of-{count:05d}.safetensors" for index in range(count)]
        for file, name in zip(files, names, strict=True):
            file.rename(folder / name)
        index = {"metadata": {"total_size": total}, "weight_map": {key: names[i] for key, i in weight_map.items()}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return {"dtype": dtype, "files": count, "tensors": len(weight_map), "bytes": total}
