"""Where tokens come from: embedded demo text, a folder of text files, a token file, or a prepared folder."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import numpy as np

from ....data.remote import default_cache_dir, is_url
from ....data.shards import hashed_here
from ....errors import RecipeError
from ....project import PROJECT
from ..config import DATA_PATH, DataConfig, ModelConfig
from .prepared import (
    TOKENIZER,
    ShardedTokens,
    describe_folder,
    open_prepared,
    open_remote,
    read_manifest,
    remote_tokenizer,
    verify,
)
from .sft import Examples, demo_examples, open_examples
from .tokenizer import load_tokenizer, vocab_size


def make_demo_text(num_sentences: int = 6000, seed: int = 0) -> str:
    """A small English-like corpus made from a grammar: offline, deterministic, quickly learnable."""
    rng = random.Random(seed)
    subjects = ["the fox", "a little bird", "the old sailor", "my sister", "the robot", "a tired cat"]
    subjects += ["the farmer", "our teacher", "the young queen", "a hungry bear"]
    verbs = ["sees", "follows", "paints", "carries", "remembers", "builds", "finds", "loves"]
    objects = ["the river", "a red apple", "the quiet house", "a long letter", "the bright moon"]
    objects += ["an empty boat", "the green hill", "a wooden box", "the morning train"]
    places = ["in the garden", "near the sea", "after dinner", "before sunrise", "under the bridge"]
    numbers = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    lines = []
    for _ in range(num_sentences):
        if rng.random() < 0.2:
            a, b = rng.randrange(5), rng.randrange(5)
            lines.append(f"{numbers[a]} plus {numbers[b]} is {numbers[a + b]}.")
        else:
            sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
            if rng.random() < 0.5:
                sentence += f" {rng.choice(places)}"
            lines.append(sentence[0].upper() + sentence[1:] + ".")
    return "\n".join(lines) + "\n"


def load_tokens(config: DataConfig) -> np.ndarray | ShardedTokens:
    """All tokens of the data source as a 1-D integer array (a memory map for token files and prepared shards)."""
    if config.source == "prepared" and is_url(config.path):
        return open_remote(str(config.path), cache_folder(config), config.cache_gb, config.shuffle_blocks)[0]
    if config.source == "prepared":
        return open_prepared(Path(config.path or ""), checksums=hashed_here(config.verify))[0]
    if config.source == "embedded":
        return np.frombuffer(make_demo_text().encode("utf-8"), dtype=np.uint8)
    path = Path(config.path or "")
    if config.source == "text":
        files = sorted(path.rglob("*.txt")) if path.is_dir() else []
        if not files:
            raise RecipeError(
                f"data.path={str(path)!r}: no .txt files found (data.source=text needs a folder of .txt files)"
            )
        text = "\n\n".join(file.read_text(encoding="utf-8", errors="replace") for file in files)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if not path.is_file():
        raise RecipeError(
            f"data.path={str(path)!r}: token file not found (data.source=tokens needs a file of {config.token_dtype} ids)"
        )
    return np.memmap(path, dtype=np.dtype(config.token_dtype), mode="r")


def load_splits(config: DataConfig, model: ModelConfig) -> tuple[Any, Any]:
    """(training, validation) tokens of the data source; refuses data the model cannot read or that is too short.

    Prepared folders bring their own split (written by `prepare`) and vocabulary, checked against
    model.vocab_size; the other sources hold out the last data.val_fraction of their tokens.
    """
    if config.source != "prepared":
        tokens = load_tokens(config)
        if (
            config.source == "tokens"
            and len(tokens)
            and (largest := int(cast(np.ndarray, tokens).max())) >= model.vocab_size
        ):
            # One vectorised pass over the memory map: an id the embedding cannot hold would otherwise fail
            # inside the first forward pass of every rank.
            raise RecipeError(
                f"data.path={config.path!r} holds token id {largest}, beyond model.vocab_size={model.vocab_size}"
                f" (set model.vocab_size >= {largest + 1}, or check data.token_dtype={config.token_dtype})"
            )
        return split_tokens(tokens, config.val_fraction, model.block_size)
    if is_url(config.path):
        tokens, manifest, tokenizer = open_remote(
            str(config.path), cache_folder(config), config.cache_gb, config.shuffle_blocks
        )
    else:
        tokens, manifest = open_prepared(Path(config.path or ""), checksums=hashed_here(config.verify))
        tokenizer = Path(config.path or "") / TOKENIZER
    check_vocab_size(config, model, manifest, tokenizer)
    if "sft" in manifest:
        raise RecipeError(
            f"data.path={config.path!r} holds chat examples (prepare --format sft): train on it with data.format: sft"
        )
    boundary = manifest["validation"]["first_token"]
    train, val = tokens.view(0, boundary), tokens.view(boundary, len(tokens))
    return _long_enough(
        train, val, model.block_size, hint="prepare more data, or prepare again with another --val_fraction"
    )


def load_example_splits(config: DataConfig, model: ModelConfig) -> tuple[Examples, Examples]:
    """(training, validation) chat examples of data.format=sft: the embedded demo, or a local prepared SFT folder."""
    if config.source == "embedded":
        examples = demo_examples()
        return examples.split(len(examples) - max(1, round(len(examples) * config.val_fraction)))
    if is_url(config.path):
        raise RecipeError(
            f"data.path={config.path!r}: data.format=sft reads a local prepared folder (copy it to each node)"
        )
    folder = Path(config.path or "")
    tokens, manifest = open_prepared(folder, checksums=hashed_here(config.verify))
    check_vocab_size(config, model, manifest, folder / TOKENIZER)
    return open_examples(folder, manifest, tokens).split(manifest["validation"]["first_example"])


def document_end(config: DataConfig) -> int:
    """The token that ends a document (data.document_mask): a prepared folder's end-of-document id, a newline for
    the byte-level sources. data.source=tokens names none (the task's checks refuse it before this)."""
    if config.source in ("embedded", "text"):
        return ord("\n")
    if config.source == "prepared":
        return int(prepared_tokenizer(config)[1]["tokenizer"]["eos_id"])
    raise RecipeError(f"data.document_mask=true: data.source={config.source} has no end-of-document token")


def cache_folder(config: DataConfig) -> Path:
    """The node-local cache of a remote prepared folder: data.cache_dir, or one under $TMPDIR named by the URL."""
    if config.cache_dir:
        return Path(config.cache_dir)
    return default_cache_dir(str(config.path), PROJECT)


def prepared_tokenizer(config: DataConfig, field: str = DATA_PATH) -> tuple[Path, dict[str, Any]]:
    """A prepared folder's tokenizer.json as a local file, and its manifest (a remote folder's come from its cache)."""
    if is_url(config.path):
        return remote_tokenizer(str(config.path), cache_folder(config), field)
    folder = Path(config.path or "")
    return folder / TOKENIZER, read_manifest(folder, field)


def describe_prepared(config: DataConfig, model: ModelConfig) -> str:
    """One line on a recipe's prepared folder (for `recipes validate`); refuses one the model cannot train on.

    Checks the manifest, the files' sizes and the vocabulary, not the checksums (`data verify` does): it is quick.
    """
    if is_url(config.path):
        return f"data: the prepared folder at {config.path} (checked when training starts; read through {cache_folder(config)})"
    folder = Path(config.path or "")
    if not folder.exists() and not folder.with_name(folder.name + ".partial").exists():
        return f"data: {folder} is not prepared yet (prepare INPUTS --out {folder} before training)"
    verify(folder, read_manifest(folder), checksums=False)
    check_vocab_size(config, model, read_manifest(folder), folder / TOKENIZER)
    return f"data: {describe_folder(folder)} at {folder}"


def check_vocab_size(config: DataConfig, model: ModelConfig, manifest: dict[str, Any], tokenizer: Path) -> None:
    """The model must hold every id of the folder's own tokenizer.json (read, not the manifest's claim) and the
    largest id `prepare` wrote (counted while writing the shards, which their digests tie to)."""
    vocabulary = vocab_size(load_tokenizer(tokenizer, DATA_PATH))
    largest = int(manifest.get("max_token_id", -1))
    needed = max(vocabulary, largest + 1)
    if model.vocab_size < needed:
        raise RecipeError(
            f"model.vocab_size={model.vocab_size} is smaller than the vocabulary of data.path={config.path!r}"
            f" ({vocabulary} tokens in its {TOKENIZER}, ids up to {largest} in its shards): set model.vocab_size"
            f" >= {needed}"
        )


def split_tokens(tokens: Any, val_fraction: float, block_size: int) -> tuple[Any, Any]:
    """Hold out the last `val_fraction` of the tokens (an array, or shards read as one) for validation."""
    num_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]
    return _long_enough(train, val, block_size, hint="use more data or change data.val_fraction")


def _long_enough(train: Any, val: Any, block_size: int, hint: str) -> tuple[Any, Any]:
    for name, part in (("training", train), ("validation", val)):
        if len(part) <= block_size:
            raise RecipeError(
                f"data: the {name} split has {len(part)} tokens, fewer than one sequence of"
                f" model.block_size={block_size}+1 ({hint})"
            )
    return train, val
