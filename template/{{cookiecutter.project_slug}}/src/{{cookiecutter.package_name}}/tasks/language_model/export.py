"""`export CHECKPOINT OUT_DIR --format hf`: a checkpoint as a Hugging Face model folder that
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.

It writes config.json, the weights as safetensors (split into files of at most `max_shard_bytes`
with a model.safetensors.index.json when larger) and, when the run trained on a prepared folder,
its tokenizer. The checkpoint is read one tensor at a time on CPU (torch.distributed.checkpoint
without a process group for sharded checkpoints, a memory map for whole ones), so no more than one
output file's tensors are held at once, whatever the size of the model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from {{ cookiecutter.package_name }}.checkpoint.layout import checkpoint_recipe, read_meta
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_class
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import MANIFEST, TOKENIZER
from {{ cookiecutter.package_name }}.tasks.language_model.hf import CONFIG, INDEX, SINGLE_FILE, export_problem, hf_config, hf_tensors

DEFAULT_SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained writes per file by default
# Module wrappers that activation checkpointing and torch.compile can leave in parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def checkpoint_tensor_reader(path: Path) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(the model's parameter names, a function reading one of them) of a checkpoint folder, without loading it all."""
    layout = strategy_class(read_meta(path)["strategy"]).checkpoint_layout
    state = path / "state"
    if layout == "sharded":
        from torch.distributed.checkpoint import FileSystemReader, load

        metadata = FileSystemReader(state).read_metadata().state_dict_metadata
        keys = {_clean(key.removeprefix("model.")): key for key in metadata if key.startswith("model.")}

        def read_sharded(name: str) -> torch.Tensor:
            entry: Any = metadata[keys[name]]
            tensor = torch.empty(entry.size, dtype=entry.properties.dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                load({keys[name]: tensor}, storage_reader=FileSystemReader(state), no_dist=True)
            return tensor

        return set(keys), read_sharded
    if layout == "replicated":
        weights = {_clean(key): value for key, value in _memory_mapped(state)["model"].items()}
        return set(weights), weights.__getitem__
    raise RecipeError(
        f"checkpoint {path}: saved by strategy {read_meta(path)['strategy']} in its own layout; export reads"
        " whole (torch.save) and torch.distributed.checkpoint layouts"
    )


def _memory_mapped(state: Path) -> dict[str, Any]:
    """A torch.save file opened by memory map: tensors are read from disk when used."""
    return torch.load(state, map_location="cpu", weights_only=True, mmap=True)


def _clean(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def hf_weights(
    recipe: Recipe, names: set[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the layout, made from the checkpoint one at a time."""
    for hf_name, spec in hf_tensors(recipe.model).items():
        if missing := [name for name in spec.sources if name not in names]:
            raise RecipeError(f"the checkpoint has no {missing[0]} (was it saved by this model family?)")
        parts = [read(name) for name in spec.sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        yield hf_name, (tensor.t() if spec.transpose else tensor).contiguous()


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


def copy_tokenizer(recipe: Recipe, folder: Path) -> int | None:
    """Copy the prepared folder's tokenizer (if the run trained on one and it is there); its EOS id, or None."""
    if recipe.data.source != "prepared" or not recipe.data.path:
        return None
    prepared = Path(recipe.data.path)
    if not (prepared / TOKENIZER).is_file():
        print(f"note: no {prepared / TOKENIZER} from here: exported without a tokenizer")
        return None
    shutil.copyfile(prepared / TOKENIZER, folder / TOKENIZER)
    tokenizer = json.loads((prepared / MANIFEST).read_text())["tokenizer"]
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": recipe.model.block_size,
        "eos_token": tokenizer["eos_token"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return tokenizer["eos_id"]


def export_hf(path: Path, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Write a complete checkpoint folder as a Hugging Face model folder (to OUT.partial, renamed when done)."""
    recipe = checkpoint_recipe(path)
    if problem := export_problem(recipe.model):
        raise RecipeError(f"checkpoint {path} cannot be exported to Hugging Face's format: {problem}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RecipeError(f"{out_dir} exists and is not empty: choose a new folder")
    if max_shard_bytes < 1:
        raise RecipeError(f"--max-shard-bytes={max_shard_bytes} must be >= 1")
    names, read = checkpoint_tensor_reader(path)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    written = write_safetensors(hf_weights(recipe, names, read), partial, max_shard_bytes)
    eos_id = copy_tokenizer(recipe, partial)
    config = hf_config(recipe.model, written["dtype"], eos_id)
    (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    partial.rename(out_dir)
    return {**written, "architecture": config["architectures"][0], "tokenizer": eos_id is not None}
