"""A prepared folder at a URL (s3://, gs://, hf://, any fsspec protocol), read through a node-local cache.

The cache is a folder on the node, named by a hash of the URL. The small files (manifest, tokenizer)
are fetched at start; the shards when first read, or ahead of that when the sampler says they come
next (`want`, a background thread). A file arrives as `<file>.partial`, is checked against the
manifest's SHA-256 as its bytes come in, then renamed into place, named by its digest (a changed
corpus never reads a stale copy). The ranks of a node share the folder: one fetches a file (an
fcntl lock per file), the others wait for it. Beyond the size bound, the files read least recently
go first (their mtime), never one this process wants (while the ranks of a node move on to the next
group at slightly different times, the group one of them still reads may pass the bound). A fetch
that fails (connection dropped, timeout, bytes that differ) is tried again after a pause, a few
times, then stops the run with one line. Credentials and endpoints come from the filesystem's usual environment and files (for S3:
AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/...), never from a recipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from .shards import Listed

TRIES = 4  # attempts per file before the run stops
FIRST_PAUSE_S = 0.5  # doubled after each failed attempt
PIECE = 1 << 20  # bytes read, hashed and written at a time


def is_url(path: str | None) -> bool:
    """Whether a data.path names a remote folder (`protocol://...`) rather than a local one."""
    return bool(path) and "://" in str(path)


def default_cache_dir(url: str, project: str) -> Path:
    """$TMPDIR/<project>-shards/<hash of the URL>: node-local, one folder per corpus."""
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"{project}-shards" / key


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed); other processes and threads wait for it."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ShardCache:
    """Files of a remote folder, fetched into a local folder of bounded size and verified as they arrive."""

    def __init__(self, url: str, folder: Path, bound_bytes: int, field: str = "url") -> None:
        import fsspec  # only a remote corpus needs it (and its protocol's package: s3fs, gcsfs, huggingface_hub)

        self.url, self.folder, self.bound_bytes, self.field = url.rstrip("/"), folder, bound_bytes, field
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise RecipeError(f"{field}={url!r}: cannot read this URL ({error})") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._wanted: set[str] = set()  # local names this process reads now or next: never evicted
        self._queue: queue.Queue[Listed] = queue.Queue()
        self._thread: threading.Thread | None = None

    def fetch_small(self, name: str) -> Path:
        """A small file with no digest to check (the manifest): fetched again each start, kept out of eviction."""
        target = self.folder / name
        with _locked(self.folder / f"{name}.lock"):
            self._with_retries(name, lambda: self._copy(name, target, None))
        return target

    def remote_sizes(self) -> dict[str, int]:
        """The size of every file in the remote folder, from one listing (not a request per file)."""
        try:
            listing = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            raise RecipeError(f"{self.field}={self.url!r}: no such folder") from None
        return {Path(entry["name"]).name: int(entry.get("size") or 0) for entry in listing}

    def local_name(self, listed: Listed) -> str:
        """The cached file's name: its digest and its name (a corpus changed in place never reads a stale copy)."""
        return f"{listed.sha256[:16]}-{listed.name}"

    def path(self, listed: Listed) -> Path:
        """The local copy of a listed file, fetched now unless it is here (waits for a rank fetching it)."""
        target = self.folder / self.local_name(listed)
        if not target.exists():
            with _locked(self.folder / f"{listed.name}.lock"):
                if not target.exists():
                    self._with_retries(listed.name, lambda: self._copy(listed.name, target, listed))
            self._evict(keep=target.name)
        with contextlib.suppress(FileNotFoundError):  # evicted by another rank meanwhile: our reader holds it
            os.utime(target)  # most recently used
        return target

    def want(self, files: Sequence[Listed]) -> None:
        """The files read next, in order: kept from eviction, and fetched in the background in that order."""
        self._wanted = {self.local_name(listed) for listed in files}
        for listed in files:
            if not (self.folder / self.local_name(listed)).exists():
                self._queue.put(listed)
        if self._thread is None:
            self._thread = threading.Thread(target=self._prefetch, name="shard-prefetch", daemon=True)
            self._thread.start()
        self._evict()

    def _prefetch(self) -> None:
        while True:
            listed = self._queue.get()
            if self.local_name(listed) not in self._wanted:
                continue  # no longer next
            # A failure here (after its retries) is not the end of the run: the reader fetches the shard itself when it
            # needs it, and reports what stops it; the thread goes on with the next shard.
            with contextlib.suppress(Exception):
                self.path(listed)

    def _with_retries(self, name: str, fetch: Callable[[], None]) -> None:
        pause = FIRST_PAUSE_S
        for attempt in range(1, TRIES + 1):
            try:
                fetch()
                return
            except FileNotFoundError:
                raise RecipeError(f"{self.field}={self.url!r}: {name} is missing (the manifest lists it)") from None
            except Exception as error:  # any failure of a transfer (dropped connection, timeout, other bytes)
                if attempt == TRIES:
                    raise RecipeError(
                        f"{self.field}={self.url!r}: fetching {name} failed {TRIES} times, the last: {error}"
                    ) from None
                print(
                    f"data: fetching {name} failed ({type(error).__name__}: {error}); retry {attempt} of"
                    f" {TRIES - 1} in {pause:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(pause)
                pause *= 2

    def _copy(self, name: str, target: Path, listed: Listed | None) -> None:
        """Copy one remote file to `target` through `target.partial`, hashing it on the way; rename when it matches."""
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as source, partial.open("wb") as out:
                while piece := source.read(PIECE):
                    digest.update(piece)
                    out.write(piece)
            if listed is not None and digest.hexdigest() != listed.sha256:
                raise ValueError(f"its bytes do not match the manifest's sha256 ({partial.stat().st_size} bytes read)")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def _evict(self, keep: str = "") -> None:
        """Remove the least recently used shards until the cache is within its bound, sparing the wanted ones."""
        with _locked(self.folder / ".evict.lock"):
            files = []
            for entry in os.scandir(self.folder):
                if entry.name.startswith(".") or entry.name.endswith((".partial", ".lock")) or "-" not in entry.name:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat()
                    files.append((stat.st_mtime, stat.st_size, entry.name))
            total = sum(size for _, size, _ in files)
            for _, size, name in sorted(files):
                if total <= self.bound_bytes:
                    break
                if name not in self._wanted and name != keep:
                    (self.folder / name).unlink(missing_ok=True)
                    total -= size


class CachedShards(Sequence[Any]):
    """The shards of a remote folder as a sequence of arrays: each one a memory map of its cached copy, opened on
    first read; `will_read` (from the sampler, through the token array) fetches ahead and releases the rest."""

    def __init__(self, cache: ShardCache, files: list[Listed], dtype: Any) -> None:
        self.cache, self.files, self.dtype = cache, files, dtype
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: Any) -> Any:
        import numpy as np

        if index not in self._open:
            self._open[index] = np.memmap(self.cache.path(self.files[index]), dtype=self.dtype, mode="r")
        return self._open[index]

    def will_read(self, shards: Sequence[int]) -> None:
        """Shards read next, in order: fetch them ahead; close the maps of the others (their disk space can go)."""
        self._open = {index: array for index, array in self._open.items() if index in shards}
        self.cache.want([self.files[index] for index in shards])
