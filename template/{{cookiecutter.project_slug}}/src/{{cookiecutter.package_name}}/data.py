"""Tokens in, micro-batches out: embedded demo text, a folder of text files, or a memory-mapped token file.

The training order is a pure function of (seed, samples seen): global sample g is window
perm_e[g mod N] of epoch e = g div N. A checkpoint stores one integer, and a resumed run continues
the exact same sequence, across epoch boundaries and also with a different number of processes,
as long as the global batch stays the same.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.schema import DataConfig

Batch = tuple[torch.Tensor, torch.Tensor]


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


def load_tokens(config: DataConfig) -> np.ndarray:
    """All tokens of the data source as a 1-D integer array (a memory map for token files)."""
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


def split_tokens(tokens: np.ndarray, val_fraction: float, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last `val_fraction` of the tokens for validation."""
    num_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]
    for name, part in (("training", train), ("validation", val)):
        if len(part) <= block_size:
            raise RecipeError(
                f"data: the {name} split has {len(part)} tokens, fewer than one sequence of"
                f" model.block_size={block_size}+1 (use more data or change data.val_fraction)"
            )
    return train, val


def _window(tokens: np.ndarray, index: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    start = index * block_size
    chunk = np.asarray(tokens[start : start + block_size + 1], dtype=np.int64)
    return chunk[:-1], chunk[1:]


def _stack(tokens: np.ndarray, indices: list[int], block_size: int) -> Batch:
    pairs = [_window(tokens, index, block_size) for index in indices]
    inputs = torch.from_numpy(np.stack([pair[0] for pair in pairs]))
    targets = torch.from_numpy(np.stack([pair[1] for pair in pairs]))
    return inputs, targets


class TrainBatches:
    """Resumable stream of training micro-batches for one data-parallel rank.

    Its state is the number of samples the whole job has consumed; save it with the checkpoint.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // block_size
        self.samples_seen = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def epoch(self) -> int:
        """Passes over the training data completed so far."""
        return self.samples_seen // self.num_windows

    def _window_of(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_windows)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_windows))
        return int(self._order[1][position])

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step; advances the stream by one global batch."""
        batches = []
        for micro_step in range(self.grad_accum_steps):
            first = self.samples_seen + (micro_step * self.dp_size + self.dp_rank) * self.micro_batch_size
            indices = [self._window_of(sample) for sample in range(first, first + self.micro_batch_size)]
            batches.append(_stack(self.tokens, indices, self.block_size))
        self.samples_seen += self.global_batch_size
        return batches

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the exact sequence."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a checkpoint made on different data."""
        if int(state["num_windows"]) != self.num_windows:
            raise RecipeError(
                f"checkpoint was made on data with {state['num_windows']} training sequences, this"
                f" recipe's data has {self.num_windows}: resume with the same data and model.block_size"
            )
        self.samples_seen = int(state["samples_seen"])
        self.seed = int(state["seed"])


def validation_batches(
    tokens: np.ndarray, block_size: int, micro_batch_size: int, num_batches: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """A fixed set of validation micro-batches for this rank (the ranks' sets are disjoint when the data allows)."""
    num_windows = (len(tokens) - 1) // block_size
    batches = []
    for batch in range(num_batches):
        first = (batch * dp_size + dp_rank) * micro_batch_size
        indices = [sample % num_windows for sample in range(first, first + micro_batch_size)]
        batches.append(_stack(tokens, indices, block_size))
    return batches
