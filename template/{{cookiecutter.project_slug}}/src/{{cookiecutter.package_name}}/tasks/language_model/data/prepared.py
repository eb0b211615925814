"""The prepared-folder format: shards written as they fill, then read by memory map and seen as one array.

    manifest.json    task, format, tokenizer (file, sha256, vocab_size, eos_id), dtype, shards (file, tokens,
                     sha256), documents, max_token_id, sources, validation split; written last
    tokenizer.json   the Hugging Face `tokenizers` tokenizer the shards were made with
    shard-NNNNN.bin  token ids, numpy `tofile` of the manifest's dtype; documents joined with EOS

A folder of chat examples (`prepare --format sft`) adds loss-mask shards and the examples' offsets,
listed in the manifest's `sft` section (sft.py).

A folder is accepted only when its manifest is complete and every file matches it, so an
interrupted `prepare` (which leaves `OUT.partial`) or a damaged shard is refused before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ....data.shards import MANIFEST, Listed, ShardWriter, check_files, check_listed, entries, field_of, load_manifest
from ....errors import RecipeError
from ..config import DATA_PATH

TOKENIZER = "tokenizer.json"
FORMAT = 1
TASK = "language_model"  # the manifest's "task": `data verify` reads the folder with this task's code
TOKEN_DTYPES = ("uint16", "uint32")  # what prepare writes: the shards are read as this type


class ShardedTokens:
    """Token shards as one read-only 1-D array: `len()` and contiguous slices, which may span shards.

    This is all the sampler needs, so a corpus of many shards keeps the exact-resume order of one
    array: window i starts at token i * block_size of the whole, wherever the shard boundaries fall.
    The shards are any sequence of arrays: memory maps of a local folder, or a remote corpus's shards
    opened from a node-local cache as they are first read (given with their `lengths` and `dtype`, so
    that nothing is fetched to learn them).
    """

    def __init__(
        self,
        shards: Sequence[np.ndarray],
        start: int = 0,
        stop: int | None = None,
        lengths: Sequence[int] | None = None,
        dtype: Any = None,
    ) -> None:
        self.shards = shards
        lengths = [len(shard) for shard in shards] if lengths is None else lengths
        self.offsets = np.cumsum([0, *lengths])  # offsets[i]: first token of shard i
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop
        if dtype is None:
            dtype = shards[0].dtype if len(lengths) else np.uint16
        self._dtype = np.dtype(dtype)

    @property
    def dtype(self) -> np.dtype:
        """The shards' integer type."""
        return self._dtype

    def shard_starts(self) -> np.ndarray:
        """Where each shard that overlaps this array begins, in this array's positions (the first clipped to 0)."""
        first, last = self._shard_of(self.start), self._shard_of(max(self.start, self.stop - 1))
        return np.clip(self.offsets[first : last + 1] - self.start, 0, None)

    def will_read(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Token ranges [start, stop) read next, in order: shards that come from a cache are fetched ahead and kept."""
        hint = getattr(self.shards, "will_read", None)
        if hint is None:
            return
        shards: list[int] = []
        for start, stop in ranges:
            stop = min(stop, len(self))
            if start < stop:
                shards += range(self._shard_of(self.start + start), self._shard_of(self.start + stop - 1) + 1)
        hint(list(dict.fromkeys(shards)))

    def _shard_of(self, token: int) -> int:
        return int(np.searchsorted(self.offsets, token, side="right")) - 1

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> ShardedTokens:
        """Tokens [start, stop) of this array, without copying."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"view [{start}, {stop}) outside [0, {len(self)})")
        lengths = np.diff(self.offsets).tolist()
        return ShardedTokens(self.shards, self.start + start, self.start + stop, lengths=lengths, dtype=self.dtype)

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        start, stop, _ = index.indices(len(self))
        start, stop = self.start + start, self.start + max(start, stop)
        parts = []
        shard = self._shard_of(start)
        while start < stop:
            offset = int(self.offsets[shard])
            end = min(stop, int(self.offsets[shard + 1]))
            parts.append(self.shards[shard][start - offset : end - offset])
            start, shard = end, shard + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)


class TokenShardWriter(ShardWriter):
    """Appends tokens to PREFIX-NNNNN.bin files of `shard_tokens` tokens each, noting the largest token id."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, prefix: str = "shard") -> None:
        super().__init__(folder, prefix, shard_tokens, "tokens", {"file": (".bin", "sha256")})
        self.dtype = dtype
        self.max_token_id = -1

    def write(self, *columns: Any) -> None:
        """Append one array of tokens, starting new shards as they fill."""
        (tokens,) = columns
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        super().write(tokens.astype(self.dtype, copy=False))


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


def read_manifest(folder: Path, field: str = DATA_PATH, where: str | None = None) -> dict[str, Any]:
    """The manifest of a complete prepared folder; refuses a missing, unfinished or foreign one, and one whose
    entries are not what this code reads (`listed_files`, the tokenizer's ids, the validation split). `where`:
    how to name the folder (a URL's cache)."""
    manifest = load_manifest(
        folder, field, f"prepare INPUTS --out {folder}", FORMAT, needs=("tokenizer", "dtype", "shards")
    )
    where = where or f"{field}={str(folder)!r}"
    listed_files(manifest, where)
    for key in ("vocab_size", *(["eos_id"] if "eos_id" in manifest["tokenizer"] else [])):
        field_of(where, manifest["tokenizer"], key, int, "tokenizer")
    validation = field_of(where, manifest, "validation", dict, "")
    for key in ("first_token", "tokens"):
        field_of(where, validation, key, int, "validation")
    return manifest


def listed_files(manifest: dict[str, Any], where: str) -> list[Listed]:
    """Every file a manifest lists (tokenizer, shards, an SFT folder's masks and offsets) with its size and digest;
    each entry checked first, since a manifest can come from anywhere (a bucket, a copy): one line on the first
    that is not what `prepare` writes."""
    dtype = manifest.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise RecipeError(
            f"{where}: {MANIFEST} dtype {str(dtype)[:40]!r} is not allowed (one of {', '.join(TOKEN_DTYPES)})"
        )
    tokenizer = field_of(where, manifest, "tokenizer", dict, "")
    itemsize = np.dtype(dtype).itemsize
    files = [check_listed(where, Listed(TOKENIZER, None, field_of(where, tokenizer, "sha256", str, "tokenizer")))]
    for index, shard in enumerate(entries(where, manifest["shards"], "shards")):
        tokens = field_of(where, shard, "tokens", int, f"shards[{index}]")
        name, sha256 = (field_of(where, shard, key, str, f"shards[{index}]") for key in ("file", "sha256"))
        files.append(check_listed(where, Listed(name, tokens * itemsize, sha256)))
    if isinstance(sft := manifest.get("sft"), dict):  # chat examples: one mask byte per token, int64 offsets
        for index, mask in enumerate(entries(where, sft.get("loss_mask"), "sft.loss_mask")):
            tokens = field_of(where, mask, "tokens", int, f"sft.loss_mask[{index}]")
            name, sha256 = (field_of(where, mask, key, str, f"sft.loss_mask[{index}]") for key in ("file", "sha256"))
            files.append(check_listed(where, Listed(name, tokens, sha256)))
        examples = field_of(where, sft, "examples", dict, "sft")
        count = field_of(where, examples, "count", int, "sft.examples")
        name, sha256 = (field_of(where, examples, key, str, "sft.examples") for key in ("file", "sha256"))
        files.append(check_listed(where, Listed(name, (count + 1) * 8, sha256)))
    return files


def verify(folder: Path, manifest: dict[str, Any], checksums: bool = False, field: str = DATA_PATH) -> None:
    """Refuse a folder whose files do not match its manifest: missing, another size, or (checksums) other bytes."""
    where = f"{field}={str(folder)!r}"
    check_files(folder, listed_files(manifest, where), checksums, field)


def open_prepared(
    folder: Path, field: str = DATA_PATH, checksums: bool = False
) -> tuple[ShardedTokens, dict[str, Any]]:
    """All tokens of a prepared folder as one array of memory maps, and its manifest; checked first.

    The files' presence and sizes are checked always (a stat each); their bytes only with `checksums`
    (data.verify: full, on local rank 0 of each node: data/shards.py).
    """
    manifest = read_manifest(folder, field)
    verify(folder, manifest, checksums=checksums, field=field)
    shards = [np.memmap(folder / shard["file"], dtype=manifest["dtype"], mode="r") for shard in manifest["shards"]]
    return ShardedTokens(shards), manifest


def open_remote(
    url: str, cache_dir: Path, cache_gb: float, shuffle_blocks: int, field: str = DATA_PATH
) -> tuple[ShardedTokens, dict[str, Any], Path]:
    """A prepared folder at a URL: its tokens read through a node-local cache (data/remote.py), its manifest, and
    the local copy of its tokenizer. Checked first: the manifest, every shard's size (one listing) and the cache's
    room for the shards the order reads at once."""
    from ....data.remote import CachedShards, ShardCache

    cache = ShardCache(url, cache_dir, int(cache_gb * 1e9), field)
    where = f"{field}={url!r}"
    manifest = read_manifest(cache.fetch_small(MANIFEST).parent, field, where)
    listed = listed_files(manifest, where)
    files = listed[1 : 1 + len(manifest["shards"])]
    found = cache.remote_sizes()
    for name, size, _ in files:
        if found.get(name) != size:
            state = "missing" if name not in found else f"{found[name]} bytes, {MANIFEST} says {size}"
            raise RecipeError(f"{field}={url!r}: {name} is {state} (prepare again)")
    # A group of blocks reads up to two shards a block (a window crosses into the next shard); one group is read
    # while the next is fetched, and both must stay.
    largest = max((size or 0 for _, size, _ in files), default=0)
    needed = 2 * 2 * shuffle_blocks * largest
    if needed > cache_gb * 1e9:
        raise RecipeError(
            f"data.cache_gb={cache_gb:g} is too small for data.shuffle_blocks={shuffle_blocks} on {url}: two groups of"
            f" {shuffle_blocks} blocks need up to {needed / 1e9:.6g} GB (raise data.cache_gb to at least that, or"
            " lower data.shuffle_blocks)"
        )
    tokenizer = cache.path(listed[0])
    shards = CachedShards(cache, files, manifest["dtype"])
    tokens = ShardedTokens(shards, lengths=[shard["tokens"] for shard in manifest["shards"]], dtype=manifest["dtype"])
    return tokens, manifest, tokenizer


def remote_tokenizer(url: str, cache_dir: Path, field: str = DATA_PATH) -> tuple[Path, dict[str, Any]]:
    """The local copy of a remote prepared folder's tokenizer (fetched into its cache, checked), and its manifest."""
    from ....data.remote import ShardCache

    cache = ShardCache(url, cache_dir, bound_bytes=1 << 62, field=field)  # adds one small file: evicts nothing
    where = f"{field}={url!r}"
    manifest = read_manifest(cache.fetch_small(MANIFEST).parent, field, where)
    return cache.path(listed_files(manifest, where)[0]), manifest


def verify_url(url: str, field: str = DATA_PATH) -> str:
    """`data verify URL`: the remote folder's manifest checked as a local one's, every file it lists read once and
    compared with its size and SHA-256; one line on what it holds."""
    import tempfile

    from ....data.remote import read_small, verify_remote

    where = f"{field}={url!r}"
    with tempfile.TemporaryDirectory() as folder:  # the manifest where the local reader reads it
        (Path(folder) / MANIFEST).write_bytes(read_small(url, MANIFEST, field))
        manifest = read_manifest(Path(folder), field, where)
    verify_remote(url, listed_files(manifest, where), field)
    return describe_manifest(manifest)


def describe_folder(folder: Path) -> str:
    """One line on what a prepared folder holds."""
    return describe_manifest(read_manifest(folder))


def describe_manifest(manifest: dict[str, Any]) -> str:
    """One line on what a prepared folder's manifest lists."""
    return (
        f"{sum(shard['tokens'] for shard in manifest['shards']):,} tokens in {len(manifest['shards'])} shard(s),"
        f" vocabulary {manifest['tokenizer']['vocab_size']}, validation {manifest['validation']['tokens']:,} tokens"
    )
