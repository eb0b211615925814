"""Supervised fine-tuning data: chat examples with a loss mask, written by `prepare --format sft`, packed into sequences.

A prepared SFT folder is a prepared folder (prepared.py) whose shards hold the examples one after
another (no end-of-document token added: the template ends each reply), plus

    mask-NNNNN.bin   one uint8 per token, the shards' split: 1 where the token is part of an assistant
                     reply (predicting it counts in the loss), 0 elsewhere
    examples.bin     int64 offsets: example i is tokens [offsets[i], offsets[i + 1])

and a manifest `sft` section naming them. The last val_fraction of the examples is the validation split.

Training reads sequences of model.block_size positions (`ExampleSequences`). An example of n tokens
fills n - 1 positions (inputs t[:-1], targets t[1:]); one longer than block_size + 1 tokens is cut
to that. With packing, consecutive examples fill a sequence while they fit, each attending only to
itself (per-token example ids -> a block-diagonal causal mask, positions restarting at each
example); without it, each example is one sequence. The rest is padding. Targets are
IGNORE_INDEX outside the replies and in the padding, so the loss is the mean over reply tokens.
The sequences are fixed by the data and block_size, so the sampler's order resumes them exactly.
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ....errors import RecipeError
from ..config import DATA_PATH
from .chat import (
    ChatTemplate,
    encode_conversation,
    read_conversations,
)
from .inputs import Progress, Source

IGNORE_INDEX = -100  # targets that do not count: F.cross_entropy's default ignore_index
PAD_ID = 0  # input id of padding positions (never a target)
EXAMPLES = "examples.bin"
MASK_PREFIX = "mask"


@dataclass(frozen=True)
class Examples:
    """Chat examples: token ids and loss mask (1-D arrays, or shards seen as one) and the offsets of the examples."""

    tokens: Any
    mask: Any
    offsets: np.ndarray  # int64, len = examples + 1, offsets[0] == 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def split(self, first_validation: int) -> tuple[Examples, Examples]:
        """(examples before `first_validation`, the rest), each with offsets from 0."""
        cut, end = int(self.offsets[first_validation]), int(self.offsets[-1])
        train = Examples(_part(self.tokens, 0, cut), _part(self.mask, 0, cut), self.offsets[: first_validation + 1])
        validation_offsets = self.offsets[first_validation:] - cut
        return train, Examples(_part(self.tokens, cut, end), _part(self.mask, cut, end), validation_offsets)


def _part(array: Any, start: int, stop: int) -> Any:
    """Elements [start, stop) without reading them: a slice of an array, a view of shards."""
    return array[start:stop] if isinstance(array, np.ndarray) else array.view(start, stop)


class ExampleSequences:
    """Sequences of block_size positions holding whole examples; a batch is (inputs, targets[, example ids]).

    The example ids (packing only) tell the model which positions may attend to which (families/documents.py).
    """

    def __init__(self, examples: Examples, block_size: int, packing: bool) -> None:
        self.examples, self.block_size, self.packing = examples, block_size, packing
        positions = np.minimum(np.diff(examples.offsets), block_size + 1) - 1
        if packing:
            bounds, fill = [0], 0
            for index, filled in enumerate(positions.tolist()):
                if fill + filled > block_size:
                    bounds.append(index)
                    fill = 0
                fill += filled
            bounds.append(len(positions))
            self.bounds = np.array(bounds, dtype=np.int64)  # sequence i holds examples [bounds[i], bounds[i + 1])
        else:
            self.bounds = np.arange(len(positions) + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def sequence(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Inputs, targets and example ids (-1: padding) of sequence `index`, each of block_size."""
        size = self.block_size
        inputs = np.full(size, PAD_ID, dtype=np.int64)
        targets = np.full(size, IGNORE_INDEX, dtype=np.int64)
        documents = np.full(size, -1, dtype=np.int64)
        offsets, fill = self.examples.offsets, 0
        for number, example in enumerate(range(int(self.bounds[index]), int(self.bounds[index + 1]))):
            start = int(offsets[example])
            stop = min(int(offsets[example + 1]), start + size + 1)
            tokens = np.asarray(self.examples.tokens[start:stop], dtype=np.int64)
            counted = np.asarray(self.examples.mask[start + 1 : stop], dtype=bool)
            filled = len(tokens) - 1
            inputs[fill : fill + filled] = tokens[:-1]
            targets[fill : fill + filled] = np.where(counted, tokens[1:], IGNORE_INDEX)
            documents[fill : fill + filled] = number
            fill += filled
        return inputs, targets, documents

    def batch(self, indices: Sequence[int]) -> tuple[Any, ...]:
        import torch

        rows = [self.sequence(index) for index in indices]
        parts = [torch.from_numpy(np.stack([row[part] for row in rows])) for part in range(3)]
        return tuple(parts) if self.packing else tuple(parts[:2])  # one example a row: the causal mask suffices


# --- prepare --format sft ----------------------------------------------------------------------------------


def iter_conversations(sources: list[Source], progress: Progress | None = None) -> Iterator[list[dict[str, str]]]:
    """Every conversation of the .jsonl inputs, in order; counts them per source."""
    for source in sources:
        if source.format != "jsonl":
            raise RecipeError(f"input {source.name()!r}: --format sft reads .jsonl chat records only")
        source.documents = 0
        with source.open() as handle:
            for conversation in read_conversations(source.name(), io.TextIOWrapper(handle, encoding="utf-8")):
                source.documents += 1
                yield conversation
        if progress is not None:
            progress.advance(source.size)


def rendered_texts(sources: list[Source], template: ChatTemplate) -> Iterator[str]:
    """The conversations' texts as the template renders them (what a tokenizer is trained on)."""
    return (template.render(conversation)[0] for conversation in iter_conversations(sources))


def write_examples(
    folder: Path, sources: list[Source], tokenizer: Any, template: ChatTemplate, writers: tuple[Any, Any],
    progress: Progress,
) -> tuple[np.ndarray, int]:  # fmt: skip
    """Encode every conversation into the token and mask writers; the examples' offsets (also written to
    examples.bin) and the number of tokens that count in the loss."""
    token_writer, mask_writer = writers
    offsets, loss_tokens = [0], 0
    for conversation in iter_conversations(sources, progress):
        tokens, mask = encode_conversation(tokenizer, template, conversation)
        if len(tokens) < 2:  # nothing to predict
            continue
        token_writer.write(tokens)
        mask_writer.write(mask)
        offsets.append(offsets[-1] + len(tokens))
        loss_tokens += int(mask.sum())
        progress.tokens += len(tokens)
    array = np.array(offsets, dtype=np.int64)
    (folder / EXAMPLES).write_bytes(array.tobytes())
    return array, loss_tokens


def sft_manifest(
    offsets: np.ndarray, loss_tokens: int, masks: list[dict[str, Any]], template: ChatTemplate, val_fraction: float
) -> dict[str, Any]:
    """The manifest's `sft` section and validation split of a folder whose examples end at `offsets`."""
    count = len(offsets) - 1
    if count < 2:
        raise RecipeError(f"--format sft: {count} example(s) with tokens: need at least 2 (training and validation)")
    validation = max(1, round(count * val_fraction))
    first = count - validation
    section = {
        "chat_template": template.name,
        "template_source": template.source,
        "loss_mask": masks,
        "examples": {"file": EXAMPLES, "count": count, "sha256": hashlib.sha256(offsets.tobytes()).hexdigest()},
        "loss_tokens": loss_tokens,
    }
    split = {
        "fraction": val_fraction,
        "first_token": int(offsets[first]),
        "tokens": int(offsets[-1] - offsets[first]),
        "documents": validation,
        "first_example": first,
    }
    return {"sft": section, "validation": split}


def open_examples(folder: Path, manifest: dict[str, Any], tokens: Any, field: str = DATA_PATH) -> Examples:
    """The examples of a prepared SFT folder (its files checked by prepared.verify)."""
    from .prepared import ShardedTokens

    section = manifest.get("sft")
    if not isinstance(section, dict):
        raise RecipeError(f"{field}={str(folder)!r} holds a token stream, not chat examples (data.format: sft needs"
                          " a folder written by `prepare --format sft`)")  # fmt: skip
    masks = [np.memmap(folder / mask["file"], dtype=np.uint8, mode="r") for mask in section["loss_mask"]]
    offsets = np.fromfile(folder / EXAMPLES, dtype=np.int64)
    if len(offsets) != section["examples"]["count"] + 1 or int(offsets[-1]) != len(tokens):
        raise RecipeError(f"{field}={str(folder)!r}: {EXAMPLES} does not match the shards (prepare again)")
    return Examples(tokens, ShardedTokens(masks), offsets)


# --- the embedded demo: chat examples made in code, byte-level tokens ----------------------------------------


class _Encoding(NamedTuple):
    ids: list[int]
    offsets: list[tuple[int, int]]


class ByteTokens:
    """ASCII text as byte ids, with the offsets `encode_conversation` reads (the embedded data's tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        data = text.encode("ascii")
        return _Encoding(list(data), [(i, i + 1) for i in range(len(data))])


def make_demo_conversations(count: int = 3000, seed: int = 0) -> list[list[dict[str, str]]]:
    """Short instruction conversations made from a grammar (sums, copying, counting): offline, deterministic."""
    rng = random.Random(seed)
    numbers = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    things = ["the fox", "a red apple", "the old sailor", "the quiet house", "a wooden box", "the moon"]
    conversations = []
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(5), rng.randrange(5)
            prompt, reply = f"What is {numbers[a]} plus {numbers[b]}?", f"{numbers[a + b].capitalize()}."
        elif kind == 1:
            thing = rng.choice(things)
            prompt, reply = f"Repeat: {thing}.", f"{thing.capitalize()}."
        else:
            n = rng.randrange(1, 6)
            prompt, reply = f"Count to {numbers[n]}.", " ".join(numbers[1 : n + 1]).capitalize() + "."
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        conversations.append(messages)
    return conversations


def demo_examples() -> Examples:
    """The embedded SFT data: the demo conversations in the plain template, as bytes (each reply ends with a newline)."""
    template = ChatTemplate(None, {}, "\n")
    tokens, masks, offsets = [], [], [0]
    for conversation in make_demo_conversations():
        ids, mask = encode_conversation(ByteTokens(), template, conversation)
        tokens.append(ids.astype(np.uint8))
        masks.append(mask)
        offsets.append(offsets[-1] + len(ids))
    return Examples(np.concatenate(tokens), np.concatenate(masks), np.array(offsets, dtype=np.int64))
