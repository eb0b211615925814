"""The prepared-folder format: shards written as they fill, then read by memory map and seen as one array.

    manifest.json    tokenizer (file, sha256, vocab_size, eos_id), dtype, shards (file, tokens,
                     sha256), documents, max_token_id, sources, validation split; written last
    tokenizer.json   the Hugging Face `tokenizers` tokenizer the shards were made with
    shard-NNNNN.bin  token ids, numpy `tofile` of the manifest's dtype; documents joined with EOS

A folder is accepted only when its manifest is complete and every file matches it, so an
interrupted `prepare` (which leaves `OUT.partial`) or a damaged shard is refused before training.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from {{ cookiecutter.package_name }}.data.shards import MANIFEST, Listed, check_files, load_manifest
from {{ cookiecutter.package_name }}.errors import RecipeError

TOKENIZER = "tokenizer.json"
FORMAT = 1


class ShardedTokens:
    """Token shards as one read-only 1-D array: `len()` and contiguous slices, which may span shards.

    This is all the sampler needs, so a corpus of many shards keeps the exact-resume order of one
    array: window i starts at token i * block_size of the whole, wherever the shard boundaries fall.
    """

    def __init__(self, shards: Sequence[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(shard) for shard in shards])  # offsets[i]: first token of shard i
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop

    @property
    def dtype(self) -> np.dtype:
        """The shards' integer type."""
        return self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> ShardedTokens:
        """Tokens [start, stop) of this array, without copying."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"view [{start}, {stop}) outside [0, {len(self)})")
        return ShardedTokens(self.shards, self.start + start, self.start + stop)

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        start, stop, _ = index.indices(len(self))
        start, stop = self.start + start, self.start + max(start, stop)
        parts = []
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            offset = int(self.offsets[shard])
            end = min(stop, int(self.offsets[shard + 1]))
            parts.append(self.shards[shard][start - offset : end - offset])
            start, shard = end, shard + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)


class ShardWriter:
    """Appends tokens to shard-NNNNN.bin files of `shard_tokens` tokens each; hashes them as they are written."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.max_token_id = -1
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens, starting new shards as they fill."""
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        while len(tokens):
            if self._file is None:
                name = f"shard-{len(self.shards):05d}.bin"
                self._file, self._hash, self._count = (self.folder / name).open("wb"), hashlib.sha256(), 0
                self.shards.append({"file": name, "tokens": 0, "sha256": ""})
            piece, tokens = tokens[: self.shard_tokens - self._count], tokens[self.shard_tokens - self._count :]
            data = piece.astype(self.dtype, copy=False).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(piece)
            if self._count == self.shard_tokens:
                self._close_shard()

    def close(self) -> list[dict[str, Any]]:
        """Finish the last shard; the manifest entries of all shards."""
        if self._file is not None:
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._file = None


def validation_boundary(tokens: ShardedTokens, eos: int, fraction: float) -> int:
    """First token of the validation split: the start of the document that holds the last `fraction` of tokens.

    Whole documents go to validation where possible; a single document is split at the token.
    """
    target = len(tokens) - max(1, round(len(tokens) * fraction))
    end = target
    while end > 0:  # the last end-of-document token before `target`, scanning back in pieces
        start = max(0, end - (1 << 20))
        ends = np.flatnonzero(tokens[start:end] == eos)
        if len(ends):
            return start + int(ends[-1]) + 1
        end = start
    return target


def count_token(tokens: ShardedTokens, token: int) -> int:
    """How often `token` occurs, counted in pieces (the shards stay on disk)."""
    piece = 1 << 24
    return sum(int(np.count_nonzero(tokens[start : start + piece] == token)) for start in range(0, len(tokens), piece))


def read_manifest(folder: Path, field: str = "data.path") -> dict[str, Any]:
    """The manifest of a complete prepared folder; refuses a missing, unfinished or foreign one."""
    manifest = load_manifest(folder, field, prepare_hint=f"prepare INPUTS --out {folder}")
    if manifest.get("format") != FORMAT:
        raise RecipeError(
            f"{field}={str(folder)!r}: {MANIFEST} has format {manifest.get('format')!r}, this code reads {FORMAT}"
        )
    return manifest


def verify(folder: Path, manifest: dict[str, Any], checksums: bool = False, field: str = "data.path") -> None:
    """Refuse a folder whose files do not match its manifest: missing, another size, or (checksums) other bytes."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    files = [Listed(TOKENIZER, None, manifest["tokenizer"]["sha256"])]
    files += [Listed(shard["file"], shard["tokens"] * itemsize, shard["sha256"]) for shard in manifest["shards"]]
    check_files(folder, files, checksums, field)


def open_prepared(
    folder: Path, field: str = "data.path", checksums: bool = False
) -> tuple[ShardedTokens, dict[str, Any]]:
    """All tokens of a prepared folder as one array of memory maps, and its manifest; checked first.

    The files' presence and sizes are checked always (a stat each); their bytes only with `checksums`
    (data.verify: full, on local rank 0 of each node: data/shards.py).
    """
    manifest = read_manifest(folder, field)
    verify(folder, manifest, checksums=checksums, field=field)
    shards = [np.memmap(folder / shard["file"], dtype=manifest["dtype"], mode="r") for shard in manifest["shards"]]
    return ShardedTokens(shards), manifest


def describe_folder(folder: Path) -> str:
    """One line on what a prepared folder holds."""
    manifest = read_manifest(folder)
    return (
        f"{manifest['tokens']:,} tokens in {len(manifest['shards'])} shard(s), vocabulary"
        f" {manifest['tokenizer']['vocab_size']}, validation {manifest['validation']['tokens']:,} tokens"
    )
