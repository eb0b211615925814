"""What every task's prepared folder shares: a manifest written last, and files checked against it.

Start-up cost does not grow with the corpus. A run checks what is O(number of files): the manifest,
that every file it lists is there with the size it states. Reading every byte (SHA-256, about a
second per GB) is done once, by `prepare` as it writes, and again only when asked: `data verify
PATH` (a progress bar by bytes) or `data.verify: full` in a recipe (local rank 0 of each node
hashes every file before the first step).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import RecipeError
from ..progress import counted

MANIFEST = "manifest.json"
VERIFY_MODES = ("sizes", "full")  # data.verify: what a run checks at start
PIECE = 1 << 20  # bytes hashed between progress counts
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a digest as the manifest must write it: names a cached file


class Listed(NamedTuple):
    """A file a manifest lists: its name in the folder, its size in bytes (None: unknown) and its SHA-256."""

    name: str
    size: int | None
    sha256: str


def check_listed(where: str, listed: Listed) -> Listed:
    """Refuse a manifest entry whose name is not a plain file name of the folder or whose sha256 is not 64 lowercase
    hex digits: both become file names (the shard cache names a copy by its digest), so neither may carry a path."""
    name, size, sha256 = listed
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or "\\" in name:
        raise RecipeError(f"{where}: {MANIFEST} names {str(name)[:60]!r}, not a file in the folder (refused)")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise RecipeError(f"{where}: {MANIFEST} gives {name} the size {str(size)[:30]!r}, not a count of bytes")
    if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
        raise RecipeError(
            f"{where}: {MANIFEST} gives {name} the sha256 {str(sha256)[:70]!r}, not 64 lowercase hex digits (refused)"
        )
    return listed


def entries(where: str, section: Any, key: str) -> list[dict[str, Any]]:
    """A manifest's list of file entries under `key` (shards, masks): a non-empty list of objects, else one line."""
    if not isinstance(section, list) or not section or not all(isinstance(entry, dict) for entry in section):
        shown = type(section).__name__ if section else "empty"
        raise RecipeError(f"{where}: {MANIFEST} {key} must be a non-empty list of file entries (it is {shown})")
    return section


def field_of(where: str, entry: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`entry[key]` when it is of `kind` (never a bool), not negative; else one line naming the key and what is
    allowed."""
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecipeError(f"{where}: {MANIFEST}{what and ' '}{what} has {key}={value!r:.40}, not {_kind_name(kind)}")
    if isinstance(value, int) and value < 0:
        raise RecipeError(f"{where}: {MANIFEST}{what and ' '}{what} has {key}={value}, must be >= 0")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list", float: "a number"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write a prepared folder's manifest (last: a folder without one is an unfinished prepare)."""
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def load_manifest(
    folder: Path,
    field: str,
    prepare_hint: str,
    format: int,
    kind: tuple[str, str] | None = None,
    needs: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The manifest of a finished prepare of this `format` (and `kind`: its value and what to call such a folder)
    with the keys its reader `needs`; refuses a missing folder, an unfinished prepare, an unreadable or foreign
    manifest."""
    where = f"{field}={str(folder)!r}"
    if not folder.is_dir():
        if folder.with_name(folder.name + ".partial").is_dir():
            raise RecipeError(f"{where}: not prepared: {folder}.partial is an unfinished prepare (run prepare again)")
        raise RecipeError(f"{where}: no such folder (make one with `{prepare_hint}`)")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise RecipeError(f"{where}: no {MANIFEST}: not a finished prepare (run prepare again)") from None
    except (OSError, ValueError) as error:
        raise RecipeError(f"{where}: unreadable {MANIFEST} ({error})") from None
    if not isinstance(manifest, dict):
        raise RecipeError(f"{where}: {MANIFEST} is not a JSON object")
    if kind is not None and manifest.get("kind") != kind[0]:
        raise RecipeError(f"{where}: not {kind[1]} ({MANIFEST} has no kind: {kind[0]})")
    if manifest.get("format") != format:
        raise RecipeError(f"{where}: {MANIFEST} has format {manifest.get('format')!r}, this code reads {format}")
    if missing := [key for key in needs if key not in manifest]:
        raise RecipeError(f"{where}: {MANIFEST} has no {', '.join(map(repr, missing))}: not a complete prepare")
    return manifest


def written_by(folder: Path) -> str | None:
    """The task whose `prepare` wrote the folder, as its manifest records it (`"task"`); None when the manifest
    does not say (a folder prepared before manifests named their task) or cannot be read: the reader that
    opens the folder then says what is wrong with it."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    task = manifest.get("task") if isinstance(manifest, dict) else None
    return task if isinstance(task, str) else None


class ShardWriter:
    """Appends rows to shards of `shard_rows` rows, one file per column (PREFIX-NNNNN + the column's suffix),
    hashing each file as it is written. A shard's manifest entry: each column's file, the row count under
    `count_key`, each column's SHA-256."""

    def __init__(
        self, folder: Path, prefix: str, shard_rows: int, count_key: str, columns: dict[str, tuple[str, str]]
    ) -> None:
        self.folder, self.prefix, self.shard_rows, self.count_key = folder, prefix, shard_rows, count_key
        self.columns = columns  # entry key of the file -> (file name suffix, entry key of its SHA-256)
        self.shards: list[dict[str, Any]] = []
        self._files: list[Any] | None = None
        self._hashes: list[Any] = []

    def write(self, *columns: Any) -> None:
        """Append rows: one array per column, of the same length (the bytes written are each array's)."""
        while len(columns[0]):
            if self._files is None:
                name = f"{self.prefix}-{len(self.shards):05d}"
                shard: dict[str, Any] = {key: name + suffix for key, (suffix, _) in self.columns.items()}
                shard[self.count_key] = 0
                self._files = [(self.folder / shard[key]).open("wb") for key in self.columns]
                self._hashes = [hashlib.sha256() for _ in self.columns]
                self.shards.append(shard)
            room = self.shard_rows - self.shards[-1][self.count_key]
            for file, digest, column in zip(self._files, self._hashes, columns, strict=True):
                data = column[:room].tobytes()
                file.write(data)
                digest.update(data)
            self.shards[-1][self.count_key] += len(columns[0][:room])
            columns = tuple(column[room:] for column in columns)
            if self.shards[-1][self.count_key] == self.shard_rows:
                self._close_shard()

    def close(self) -> list[dict[str, Any]]:
        """Finish the last shard; the manifest entries of all shards."""
        if self._files is not None:
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        assert self._files is not None
        for file in self._files:
            file.close()
        hashes = zip(self.columns.values(), self._hashes, strict=True)
        self.shards[-1].update({key: digest.hexdigest() for (_, key), digest in hashes})
        self._files = None


def check_files(folder: Path, files: list[Listed], checksums: bool, field: str) -> None:
    """Refuse a folder whose files do not match its manifest: missing, another size, or (checksums) other bytes.

    Sizes are one stat per file. With `checksums` every byte is read, with progress shown by bytes.
    """
    where = f"{field}={str(folder)!r}"
    sizes: list[int] = []
    for name, size, _ in (check_listed(where, listed) for listed in files):
        path = folder / name
        if not path.is_file():
            raise RecipeError(f"{where}: {name} is missing ({MANIFEST} lists it; prepare again)")
        if path.resolve().parent != folder.resolve():  # a link: the manifest's name would read another file
            raise RecipeError(f"{where}: {name} is a link that leads outside the folder (refused: copy the file in)")
        sizes.append(found := path.stat().st_size)
        if size is not None and found != size:
            raise RecipeError(f"{where}: {name} has {found} bytes, {MANIFEST} says {size} (prepare again)")
    if not checksums:
        return
    total = sum(max(1, -(-size // PIECE)) for size in sizes)
    pieces = counted(_pieces(folder, files, sizes), f"Verifying {folder}", total=total, unit="MiB")
    digest = hashlib.sha256()
    for name, sha256, piece, last in pieces:
        digest.update(piece)
        if last:
            if digest.hexdigest() != sha256:
                raise RecipeError(
                    f"{where}: {name} does not match its sha256 in {MANIFEST} (damaged or changed; prepare again)"
                )
            digest = hashlib.sha256()


def _pieces(folder: Path, files: list[Listed], sizes: list[int]) -> Iterator[tuple[str, str, bytes, bool]]:
    """Every file read in PIECE-byte pieces: (name, its expected SHA-256, the piece, whether it is the file's last)."""
    for (name, _, sha256), size in zip(files, sizes, strict=True):
        with (folder / name).open("rb") as handle:
            done = 0
            while True:
                piece = handle.read(PIECE)
                done += len(piece)
                last = not piece or done >= size  # a file cut short since its stat ends here too
                yield name, sha256, piece, last
                if last:
                    break


def hashed_here(verify: str) -> bool:
    """Whether this process reads every byte of the data at start: `data.verify: full`, on local rank 0 of a node
    (the other ranks of a node check sizes, and stop with the job if that rank refuses the folder)."""
    return verify == "full" and os.environ.get("LOCAL_RANK", "0") == "0"
