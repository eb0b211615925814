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
times, then stops the run with one line; a refusal that another try cannot change (403, 404) stops it
at once. The cache only ever touches files it made: it works in a folder it created (its marker file,
`.shard-cache`, is there) or an empty one, names its copies `<16 hex digits of the digest>-<file>`, and
evicts only files of that form. Credentials and endpoints come from the filesystem's usual environment and files (for S3:
AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/...), never from a recipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from .shards import Listed, check_listed

TRIES = 4  # attempts per file before the run stops
FIRST_PAUSE_S = 0.5  # doubled after each failed attempt
PIECE = 1 << 20  # bytes read, hashed and written at a time
# A manifest, or a file listed without a size (the tokenizer), larger than this is not one: a million shards' manifest
# and the largest tokenizer.json files in use fit in less.
SMALL_FILE_BYTES = 64 << 20
MARKER = ".shard-cache"  # in every folder the cache made: the cache writes and evicts nowhere else
CACHED = re.compile(r"[0-9a-f]{16}-[^/\\]+")  # the name of a copy the cache made (local_name)
# A refusal from the store that another try cannot change: the file or folder is not there, or not readable.
PERMANENT_CODES = frozenset({"AccessDenied", "NoSuchKey", "NoSuchBucket", "403", "404", "Forbidden", "NotFound"})


class _TooLarge(Exception):
    """A small file (the manifest, the tokenizer) that is not small: never retried."""


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
        self._claim_folder()
        self._wanted: set[str] = set()  # local names this process reads now or next: never evicted
        self._queue: queue.Queue[Listed] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _claim_folder(self) -> None:
        """Use the folder only when the cache made it, or it is new or empty (then mark it as the cache's): a
        folder of the user's is refused, so that eviction never deletes a file the cache did not write."""
        where = f"{self.field}={self.url!r}: the shard cache {str(self.folder)!r}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not (self.folder / MARKER).is_file():
                if any(os.scandir(self.folder)):
                    raise RecipeError(
                        f"{where} is a folder that is not empty and not a shard cache (no {MARKER} in it); the cache"
                        " writes and evicts files only in a folder of its own: choose a new or empty folder"
                        " (data.cache_dir)"
                    )
                (self.folder / MARKER).write_text("A cache of remote data shards: its files may be deleted.\n")
        except (NotADirectoryError, FileExistsError, PermissionError) as error:
            raise RecipeError(f"{where} cannot be used ({error.strerror or error})") from None

    def fetch_small(self, name: str) -> Path:
        """A small file with no digest to check (the manifest): fetched again each start (at most SMALL_FILE_BYTES),
        kept out of eviction."""
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
        """The cached file's name: its digest and its name (a corpus changed in place never reads a stale copy).
        Both come from the manifest: checked to be a hex digest and a plain file name first."""
        check_listed(f"{self.field}={self.url!r}", listed)
        return f"{listed.sha256[:16]}-{listed.name}"

    def path(self, listed: Listed) -> Path:
        """The local copy of a listed file, fetched now unless it is here (waits for a rank fetching it)."""
        target = self.folder / self.local_name(listed)
        if target.is_symlink() or target.resolve().parent != self.folder.resolve():
            raise RecipeError(f"{self.field}={self.url!r}: {target} leads outside the shard cache (refused)")
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
            except _TooLarge as error:
                raise RecipeError(f"{self.field}={self.url!r}: {name} {error}") from None
            except Exception as error:  # any failure of a transfer (dropped connection, timeout, other bytes)
                if permanent(error):
                    raise RecipeError(f"{self.field}={self.url!r}: fetching {name} was refused: {error}") from None
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
        """Copy one remote file to `target` through `target.partial`, hashing it on the way; rename when it matches.
        A file without a listed size (the manifest, the tokenizer) stops at SMALL_FILE_BYTES."""
        partial = target.with_name(target.name + ".partial")
        too_large = "not a manifest (refused)" if listed is None else "more than a small file can be (refused)"
        digest = hashlib.sha256()
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as source, partial.open("wb") as out:
                read = 0
                while piece := source.read(PIECE):
                    read += len(piece)
                    if (listed is None or listed.size is None) and read > SMALL_FILE_BYTES:
                        raise _TooLarge(f"is larger than {SMALL_FILE_BYTES >> 20} MiB: {too_large}")
                    digest.update(piece)
                    out.write(piece)
            if listed is not None and digest.hexdigest() != listed.sha256:
                raise ValueError(f"its bytes do not match the manifest's sha256 ({partial.stat().st_size} bytes read)")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def _evict(self, keep: str = "") -> None:
        """Remove the least recently used shards until the cache is within its bound, sparing the wanted ones; only
        copies the cache made (named as local_name names them, plain files) are candidates."""
        with _locked(self.folder / ".evict.lock"):
            files = []
            for entry in os.scandir(self.folder):
                cached = CACHED.fullmatch(entry.name) and not entry.name.endswith((".partial", ".lock"))
                if not cached or not entry.is_file(follow_symlinks=False):
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


def permanent(error: BaseException) -> bool:
    """Whether a failed fetch is a refusal that another try cannot change: no such file or bucket, no access."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    response = getattr(error, "response", None)  # botocore's ClientError, as s3fs passes some on
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    status = getattr(error, "status", None) or getattr(error, "status_code", None)
    return code in PERMANENT_CODES or status in (401, 403, 404)


def read_small(url: str, name: str, field: str) -> bytes:
    """One small file of a remote folder (its manifest), read whole: at most SMALL_FILE_BYTES, else one line."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
        with fs.open(f"{root}/{name}", "rb") as handle:
            data = handle.read(SMALL_FILE_BYTES + 1)
    except (ImportError, ValueError) as error:
        raise RecipeError(f"{field}={url!r}: cannot read this URL ({error})") from None
    except FileNotFoundError:
        raise RecipeError(f"{field}={url!r}: no {name} there (not a prepared folder)") from None
    except Exception as error:  # the store's refusal or a failed transfer: one line, as a run says it
        raise RecipeError(f"{field}={url!r}: reading {name} failed: {error}") from None
    if len(data) > SMALL_FILE_BYTES:
        raise RecipeError(f"{field}={url!r}: {name} is larger than {SMALL_FILE_BYTES >> 20} MiB: not a manifest")
    return data


def verify_remote(url: str, files: list[Listed], field: str) -> None:
    """Every listed file of a remote folder read once and compared with its size and SHA-256 (nothing is kept)."""
    import fsspec

    from ..progress import counted

    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    found = {Path(entry["name"]).name: int(entry.get("size") or 0) for entry in fs.ls(root, detail=True)}
    for name, size, _ in files:
        if name not in found or (size is not None and found[name] != size):
            state = "missing" if name not in found else f"{found[name]} bytes, the manifest says {size}"
            raise RecipeError(f"{field}={url!r}: {name} is {state} (prepare again)")
    total = sum(max(1, -(-found[name] // PIECE)) for name, _, _ in files)
    progress = counted(range(total), f"Verifying {url}", total=total, unit="MiB")
    for name, _, sha256 in files:
        digest = hashlib.sha256()
        try:
            with fs.open(f"{root}/{name}", "rb") as source:
                while piece := source.read(PIECE):
                    digest.update(piece)
                    next(progress, None)
        except Exception as error:  # the store's refusal or a failed transfer
            raise RecipeError(f"{field}={url!r}: reading {name} failed: {error}") from None
        if digest.hexdigest() != sha256:
            raise RecipeError(f"{field}={url!r}: {name} does not match its sha256 in the manifest (damaged or changed)")
    for _ in progress:  # the bar to its end (empty files count a piece each)
        pass


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
