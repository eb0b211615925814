"""`export CHECKPOINT OUT_DIR --format hf`: a checkpoint as a Hugging Face model folder that
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.

It writes config.json, generation_config.json, the weights as safetensors (split into files of at most
`max_shard_bytes` with a model.safetensors.index.json when larger) and the tokenizer the run read its data
with (tokenizer.json, tokenizer_config.json: `transformers.AutoTokenizer.from_pretrained(OUT_DIR)` gives the
same ids): a prepared folder's, or for the byte-level sources one that maps each byte to its own id. The checkpoint is read one tensor at a time on CPU (torch.distributed.checkpoint
without a process group for sharded checkpoints, a memory map for whole ones), so no more than one
output file's tensors are held at once, whatever the size of the model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ...checkpoint.layout import checkpoint_recipe, new_partial, removed_unless_finished
from ...checkpoint.tensors import DEFAULT_SHARD_BYTES, checkpoint_tensor_reader, write_safetensors
from ...errors import RecipeError
from ...progress import counted
from ...recipe.schema import Recipe
from .config import LanguageModelRecipe
from .data.prepared import MANIFEST, TOKENIZER
from .data.tokenizer import byte_tokenizer
from .hf import CONFIG, export_problem, hf_config, hf_tensors

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
BYTE_SOURCES = ("embedded", "text")  # data sources read as UTF-8 bytes: each byte is a token id


def hf_weights(
    recipe: Recipe, names: set[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the layout, made from the checkpoint one at a time."""
    stacked: tuple[str, torch.Tensor] | None = None  # the expert weight last read: its experts come one after another
    for hf_name, spec in hf_tensors(recipe.model).items():
        if missing := [name for name in spec.sources if name not in names]:
            raise RecipeError(f"the checkpoint has no {missing[0]} (was it saved by this model family?)")
        if spec.expert is not None:
            (name,) = spec.sources
            if stacked is None or stacked[0] != name:
                stacked = name, read(name)
            yield hf_name, stacked[1][spec.expert].contiguous()
            continue
        parts = [read(name) for name in spec.sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        yield hf_name, (tensor.t() if spec.transpose else tensor).contiguous()


def write_tokenizer(recipe: Recipe, folder: Path) -> tuple[bool, int | None]:
    """The export's tokenizer: for the byte-level sources (embedded, text) one that maps each byte to its own id,
    for a prepared folder a copy of its tokenizer (when it is there). (written, its end-of-document id or None)."""
    if recipe.data.source in BYTE_SOURCES:
        byte_tokenizer().save(str(folder / TOKENIZER))
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": recipe.model.block_size}
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
        return True, None
    eos_id = copy_tokenizer(recipe, folder)
    return eos_id is not None, eos_id


def copy_tokenizer(recipe: Recipe, folder: Path) -> int | None:
    """Copy the prepared folder's tokenizer (if the run trained on one and it is there); its EOS id, or None."""
    if recipe.data.source != "prepared" or not recipe.data.path:
        return None
    from ...data.remote import is_url
    from .data.sources import prepared_tokenizer

    prepared = Path(recipe.data.path)
    if is_url(recipe.data.path):  # a remote folder's tokenizer comes through its cache
        try:
            source, manifest = prepared_tokenizer(recipe.data)
        except RecipeError as error:
            print(f"note: {error}: exported without a tokenizer")
            return None
    elif not (prepared / TOKENIZER).is_file():
        print(f"note: no {prepared / TOKENIZER} from here: exported without a tokenizer")
        return None
    else:
        source, manifest = prepared / TOKENIZER, json.loads((prepared / MANIFEST).read_text())
    shutil.copyfile(source, folder / TOKENIZER)
    tokenizer = manifest["tokenizer"]
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": recipe.model.block_size,
        "eos_token": tokenizer["eos_token"],
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return tokenizer["eos_id"]


def generation_config(recipe: Recipe, eos_id: int | None) -> dict[str, Any]:
    """generation_config.json: what `generate` starts from, stops at and pads with, as the project's `sample` and
    `evaluate` do: a prepared folder's end-of-document token; for bytes, where no token ends a document, a newline
    starts an unprompted text and pads (the same choice as evaluate's), and nothing stops generation early."""
    if recipe.data.source in BYTE_SOURCES:
        newline = ord("\n")
        return {"bos_token_id": newline, "pad_token_id": newline, "max_length": recipe.model.block_size}
    return {
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "max_length": recipe.model.block_size,
    }


def export_hf(path: Path, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Write a complete checkpoint folder as a Hugging Face model folder (to OUT.partial, renamed when done);
    a LoRA run's adapters are merged into the base weights."""
    recipe = cast(LanguageModelRecipe, checkpoint_recipe(path))
    if problem := export_problem(recipe.model):
        raise RecipeError(f"checkpoint {path} cannot be exported to Hugging Face's format: {problem}")
    check_new_folder(out_dir)
    if max_shard_bytes < 1:
        raise RecipeError(f"--max_shard_bytes={max_shard_bytes} must be >= 1")
    names, read = checkpoint_tensor_reader(path)
    if recipe.lora.rank:  # the checkpoint holds adapters: merged into init_from's weights
        from .lora import merged_reader

        names, read = merged_reader(recipe, names, read)
    with removed_unless_finished(new_partial(out_dir)) as partial:
        weights = counted(
            hf_weights(recipe, names, read), f"Exporting {path}", len(hf_tensors(recipe.model)), "tensors"
        )
        written = write_safetensors(weights, partial, max_shard_bytes)
        has_tokenizer, eos_id = write_tokenizer(recipe, partial)
        config = hf_config(recipe.model, written["dtype"], eos_id)
        (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (partial / GENERATION_CONFIG).write_text(json.dumps(generation_config(recipe, eos_id), indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        partial.rename(out_dir)
    return {
        **written,
        "architecture": config["architectures"][0],
        "tokenizer": has_tokenizer,
        # What lm-eval's Hugging Face backend must be told to start a text with when the tokenizer has no such token.
        "newline_prefix": ord("\n") if recipe.data.source in BYTE_SOURCES else None,
    }


def export_adapters(path: Path, out_dir: Path) -> dict[str, Any]:
    """Write a LoRA checkpoint's adapters as a peft adapter folder (to OUT.partial, renamed when done)."""
    from .lora import write_adapter_folder

    recipe = cast(LanguageModelRecipe, checkpoint_recipe(path))
    if not recipe.lora.rank:
        raise RecipeError(f"checkpoint {path} has no adapters (lora.rank=0): export it with --format hf")
    check_new_folder(out_dir)
    names, read = checkpoint_tensor_reader(path)
    with removed_unless_finished(new_partial(out_dir)) as partial:
        written = write_adapter_folder(recipe, names, read, partial)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        partial.rename(out_dir)
    return {**written, "base": recipe.model.init_from}


def check_new_folder(out_dir: Path) -> None:
    """Refuse an output folder that holds anything."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RecipeError(f"{out_dir} exists and is not empty: choose a new folder")
