"""`prepare`: .txt, .jsonl and .parquet files -> token shards, manifest.json and tokenizer.json in one folder.

    prepare data/raw --train_tokenizer 32000 --out data/prepared
    prepare 'data/raw/**/*.jsonl' --tokenizer tokenizer.json --text_field content --out data/prepared

A document is a whole .txt file, the text field of a .jsonl line, or the text column of a .parquet
row. Documents are tokenized in input order, each followed by the tokenizer's end-of-document
token, and written to shards of `shard_tokens` tokens (uint16 when the vocabulary fits, else
uint32). Tokenizing runs in `workers` processes and the results are written in reading order, so
the same inputs give the same bytes whatever the number of workers. Everything is written to
`OUT.partial` and renamed to `OUT` after the manifest, so an interrupted prepare leaves nothing
that training accepts (see prepared.py for the folder's layout).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.checkpoint.layout import new_partial
from {{ cookiecutter.package_name }}.cluster.lifecycle import end_with_parent
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import (
    FORMAT,
    MANIFEST,
    TOKENIZER,
    ShardedTokens,
    ShardWriter,
    count_token,
    validation_boundary,
)
from {{ cookiecutter.package_name }}.tasks.language_model.data.tokenizer import eos_id, load_tokenizer, train_byte_level_bpe, vocab_size

# .arrow: the files of a Hugging Face `datasets` folder written by save_to_disk (found by its state.json).
FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
SAVED_STATE, SAVED_SPLITS = "state.json", "dataset_dict.json"
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard: few files (each stays memory-mapped) even for 100B tokens
BATCH_CHARS = 1 << 20  # text per task sent to a worker: large enough that the transfer costs little
LOG_EVERY_SECONDS = 10.0
ENGINES = ("local", "ray")  # where tokenizing runs: processes on this machine, or Ray tasks (distributed.py)


@dataclass
class Source:
    """One input file and what was read from it: a local path, or a path on an fsspec filesystem (a URL's)."""

    path: str
    format: str
    size: int
    fs: Any = None  # the fsspec filesystem of a URL input; None for a local file
    documents: int = 0

    def open(self) -> IO[bytes]:
        """The file's bytes."""
        return self.fs.open(self.path, "rb") if self.fs is not None else open(self.path, "rb")

    def name(self) -> str:
        """As the manifest records it: the path as found, or the URL."""
        return self.path if self.fs is None else self.fs.unstrip_protocol(self.path)


def find_inputs(inputs: list[str]) -> list[Source]:
    """The input files, in a fixed order: each folder's files sorted, globs sorted, duplicates dropped.

    A URL (`hf://datasets/...`, `s3://...`, any fsspec protocol) is listed through fsspec; a folder
    written by Hugging Face `datasets`' `save_to_disk` is read as its arrow files in the order its
    state.json gives.
    """
    found: dict[str, Source] = {}
    for item in inputs:
        for source in _remote_inputs(item) if "://" in item else _local_inputs(item):
            if Path(source.path).suffix not in FORMATS:
                raise RecipeError(f"input {source.name()!r}: unsupported file type (use {', '.join(FORMATS)})")
            found.setdefault(source.name(), source)
    if not found:
        raise RecipeError(f"inputs {' '.join(inputs)}: no {', '.join(FORMATS)} files found (empty input)")
    return list(found.values())


def _local_inputs(item: str) -> list[Source]:
    path = Path(item)
    if path.is_dir() and ((path / SAVED_STATE).is_file() or (path / SAVED_SPLITS).is_file()):
        matches = [path / name for name in _saved_dataset_files(item, lambda name: (path / name).read_text())]
    elif path.is_dir():
        matches = sorted(p for p in path.rglob("*") if p.suffix in FORMATS and p.is_file())
    elif path.is_file():
        matches = [path]
    else:
        matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
        if not matches:
            raise RecipeError(f"input {item!r}: no such file or folder, and no file matches it as a glob")
    return [Source(str(match), FORMATS.get(match.suffix, ""), match.stat().st_size) for match in matches]


def _remote_inputs(item: str) -> list[Source]:
    """The files of a URL: a file, a folder (its files of the known types, sorted), a saved dataset or a glob."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(item)
    except (ImportError, ValueError) as error:  # an unknown protocol, or its package (s3fs, gcsfs) not installed
        raise RecipeError(f"input {item!r}: {_first_line(error)}") from None
    try:
        if fs.isdir(path) and (fs.isfile(f"{path}/{SAVED_STATE}") or fs.isfile(f"{path}/{SAVED_SPLITS}")):
            matches = [
                f"{path}/{name}"
                for name in _saved_dataset_files(item, lambda name: fs.cat_file(f"{path}/{name}").decode())
            ]
        elif fs.isdir(path):
            matches = sorted(p for p in fs.find(path) if Path(p).suffix in FORMATS)
        elif fs.isfile(path):
            matches = [path]
        else:
            matches = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not matches:
                raise RecipeError(f"input {item!r}: no such file or folder, and no file matches it as a glob")
        return [Source(match, FORMATS.get(Path(match).suffix, ""), fs.size(match), fs) for match in matches]
    except RecipeError:
        raise
    except Exception as error:  # the filesystem's own: no network, no credentials, no such bucket
        raise RecipeError(f"input {item!r}: cannot list it ({type(error).__name__}: {_first_line(error)})") from None


def _saved_dataset_files(item: str, read: Callable[[str], str]) -> list[str]:
    """The arrow files of a `save_to_disk` dataset, in its order; a DatasetDict is refused, naming its splits."""
    try:
        state = json.loads(read(SAVED_STATE))
        return [entry["filename"] for entry in state["_data_files"]]
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        pass
    try:
        splits = json.loads(read(SAVED_SPLITS))["splits"]
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        raise RecipeError(f"input {item!r}: a saved dataset without a readable {SAVED_STATE}") from None
    raise RecipeError(
        f"input {item!r}: a DatasetDict of splits {', '.join(map(str, splits))}: name one split's folder"
        f" (e.g. {item.rstrip('/')}/{splits[0] if splits else 'train'})"
    )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _arrow_batches(handle: IO[bytes]) -> Any:
    """A reader of an arrow file's record batches: the IPC stream `datasets` writes, or the IPC file format."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(handle)
    except pa.ArrowInvalid:
        handle.seek(0)
        file = pa.ipc.open_file(handle)
        return _FileBatches(file)


class _FileBatches:
    """An IPC file read like a stream: its schema and its batches in order."""

    def __init__(self, file: Any) -> None:
        self.file, self.schema = file, file.schema

    def __iter__(self) -> Iterator[Any]:
        return (self.file.get_batch(i) for i in range(self.file.num_record_batches))


def _columns(source: Source) -> list[str]:
    import pyarrow.parquet as pq

    with source.open() as handle:
        if source.format == "parquet":
            return list(pq.read_schema(handle).names)
        return list(_arrow_batches(handle).schema.names)


def check_text_field(sources: list[Source], text_field: str) -> None:
    """Refuse, before anything is written, a .parquet/.arrow file without the text column or a .jsonl whose first
    record lacks it."""
    for source in sources:
        if source.format in ("parquet", "arrow"):
            columns = _columns(source)
            if text_field not in columns:
                raise RecipeError(
                    f"{source.name()}: no column {text_field!r} (columns: {', '.join(columns)}; choose with --text_field)"
                )
        elif source.format == "jsonl":
            with source.open() as handle:
                for number, line in enumerate(io.TextIOWrapper(handle, encoding="utf-8"), 1):
                    if line.strip():
                        _text_of(line, source.name(), number, text_field)
                        break


def _text_of(line: str, path: str, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise RecipeError(f"{path}:{number}: not valid JSON ({error})") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise RecipeError(f"{path}:{number}: no text field {text_field!r} (found: {keys}; choose with --text_field)")
    return text


def read_documents(source: Source, text_field: str) -> Iterator[tuple[str, int]]:
    """(document, input bytes consumed) for every non-empty document of one file, in file order."""
    with source.open() as handle:
        if source.format == "txt":
            text = io.TextIOWrapper(handle, encoding="utf-8", errors="replace").read()
            if text:
                yield text, source.size
        elif source.format == "jsonl":
            for number, line in enumerate(io.TextIOWrapper(handle, encoding="utf-8"), 1):
                if line.strip() and (text := _text_of(line, source.name(), number, text_field)):
                    yield text, len(line)
        else:
            if source.format == "parquet":
                import pyarrow.parquet as pq

                parquet = pq.ParquetFile(handle)
                rows = parquet.metadata.num_rows
                record_batches = parquet.iter_batches(columns=[text_field], batch_size=1024)
            else:
                reader = _arrow_batches(handle)
                rows = None
                record_batches = (batch.select([text_field]) for batch in reader)
            for batch in record_batches:
                texts = batch.column(0).to_pylist()
                per_row = source.size // max(rows or len(texts), 1)
                for text in texts:
                    if text:
                        yield text, per_row


def iter_documents(sources: list[Source], text_field: str, progress: Progress | None = None) -> Iterator[str]:
    """Every document of every source, in order; counts them per source."""
    for source in sources:
        source.documents = 0
        for text, consumed in read_documents(source, text_field):
            source.documents += 1
            if progress is not None:
                progress.advance(consumed)
            yield text


class Progress:
    """A bar on a terminal, a plain line every LOG_EVERY_SECONDS otherwise (a log file, a batch job)."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self.bar = None
        self.enabled = enabled
        self._last_line = time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # The size is read once; a terminal reporting 0 columns or rows (some ptys) would hide tqdm's bar.
            columns, rows = shutil.get_terminal_size()
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                            ncols=columns, nrows=rows)  # fmt: skip

    def advance(self, consumed: int) -> None:
        """Count input bytes read."""
        self.done += consumed
        if self.bar is not None:
            self.bar.update(consumed)
        elif self.enabled and time.monotonic() - self._last_line >= LOG_EVERY_SECONDS:
            self._last_line = time.monotonic()
            read = f"{self.done / 2**20:.0f} of {self.total / 2**20:.0f} MiB read"
            print(f"prepare: {read}, {self.tokens:,} tokens written", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_json: str, parent_pid: int) -> None:
    global _worker_tokenizer
    end_with_parent(parent_pid)  # a killed `prepare` leaves no worker behind
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str], eos: int, dtype: str) -> np.ndarray:
    """Token ids of the documents, each followed by the end-of-document id (runs in a worker process)."""
    assert _worker_tokenizer is not None
    return encode_documents(_worker_tokenizer, texts, eos, dtype)


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos: int, dtype: str) -> np.ndarray:
    """Token ids of the documents, each followed by the end-of-document id."""
    # encode_batch_fast (tokenizers >= 0.21) gives the same ids without computing character offsets.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    tokens = np.empty(sum(len(encoding.ids) + 1 for encoding in encodings), dtype=dtype)
    position = 0
    for encoding in encodings:
        ids = encoding.ids
        tokens[position : position + len(ids)] = ids
        tokens[position + len(ids)] = eos
        position += len(ids) + 1
    return tokens


@contextmanager
def _sequential_tokenizers() -> Iterator[None]:
    """Workers tokenize one document at a time each: the processes are the parallelism.

    Set while the pool forks, it also keeps `tokenizers` from warning that it was forked after
    using its threads (training a tokenizer does).
    """
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_to_shards(
    documents: Iterator[str], tokenizer: Tokenizer, eos: int, writer: ShardWriter, workers: int, progress: Progress
) -> None:
    """Tokenize documents in `workers` processes and write the results in reading order."""
    # fork: workers start in milliseconds and need nothing re-imported; spawn elsewhere (macOS, Windows).
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    tokenizer_json = tokenizer.to_str()
    dtype = writer.dtype.name
    initargs = (tokenizer_json, os.getpid())
    with _sequential_tokenizers(), ProcessPoolExecutor(workers, context, _start_worker, initargs) as pool:
        pending: deque = deque()
        for batch in batches(documents):
            pending.append(pool.submit(_encode, batch, eos, dtype))
            if len(pending) > 2 * workers:  # bounded: reading stays a little ahead of tokenizing
                _write(writer, pending.popleft().result(), progress)
        while pending:
            _write(writer, pending.popleft().result(), progress)


def _write(writer: ShardWriter, tokens: np.ndarray, progress: Progress) -> None:
    writer.write(tokens)
    progress.tokens += len(tokens)


def prepare(
    inputs: list[str],
    out: str,
    tokenizer_file: str | None = None,
    train_tokenizer: int | None = None,
    text_field: str = "text",
    val_fraction: float = 0.01,
    workers: int | None = None,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    engine: str = "local",
    tasks: int | None = None,
) -> dict[str, Any]:
    """Tokenize the inputs into a prepared folder at `out` (a folder or a URL); return its manifest.

    Checks everything it can first. `engine="ray"` tokenizes in `tasks` Ray tasks (distributed.py);
    the folder is the same, byte for byte.
    """
    if (tokenizer_file is None) == (train_tokenizer is None):
        raise RecipeError("prepare needs exactly one of --tokenizer tokenizer.json or --train_tokenizer VOCAB_SIZE")
    if not 0 < val_fraction < 1:
        raise RecipeError(f"--val_fraction {val_fraction:g} must be in (0, 1)")
    if engine not in ENGINES:
        raise RecipeError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "ray":
        if workers is not None:
            raise RecipeError("--workers counts the processes of --engine local; with --engine ray, use --tasks")
        from {{ cookiecutter.package_name }}.tasks.language_model.data.distributed import require_ray

        require_ray()
    elif tasks is not None:
        raise RecipeError("--tasks counts the tasks of --engine ray; with --engine local, use --workers")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers < 1 or shard_tokens < 1 or (tasks is not None and tasks < 1):
        raise RecipeError(f"--workers {workers}, --tasks {tasks} and --shard_tokens {shard_tokens} must be >= 1")
    destination = Destination(out)
    sources = find_inputs(inputs)
    if sum(source.size for source in sources) == 0:
        raise RecipeError(f"inputs {' '.join(inputs)}: all {len(sources)} files are empty (empty input)")
    check_text_field(sources, text_field)
    tokenizer = None if tokenizer_file is None else load_tokenizer(Path(tokenizer_file))
    if tokenizer is not None:
        eos_id(tokenizer, f"--tokenizer {tokenizer_file!r}")

    with destination.local_folder() as target:
        partial = new_partial(target)
        try:
            if tokenizer is None:
                tokenizer = train_byte_level_bpe(
                    iter_documents(sources, text_field), train_tokenizer or 0, progress and sys.stderr.isatty()
                )
                _refuse_empty(sources, inputs)
            parallel = Parallel(engine, workers, tasks or len(sources))
            manifest = _write_folder(
                partial, sources, tokenizer, text_field, val_fraction, parallel, shard_tokens, progress
            )
            _refuse_empty(sources, inputs)
            manifest["tokenizer"]["trained_on_inputs"] = train_tokenizer is not None
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        destination.upload(target)
    return manifest


@dataclass
class Parallel:
    """How tokenizing is spread: `workers` processes here (local) or `tasks` Ray tasks (ray)."""

    engine: str
    workers: int
    tasks: int


class Destination:
    """Where `--out` points: a local folder, or a URL (any fsspec protocol) that a local copy is uploaded to.

    A URL's folder is written locally first (in a temporary folder under $TMPDIR, `OUT.partial` as
    for a folder), then uploaded file by file with manifest.json last: a reader never finds a
    manifest without its shards, and an interrupted upload leaves no manifest at the URL (a
    prepared folder without one is refused, and `prepare` refuses to write over it).
    """

    def __init__(self, out: str) -> None:
        self.out, self.fs, self.path = out, None, out
        if "://" in out:
            import fsspec

            try:
                self.fs, self.path = fsspec.core.url_to_fs(out)
                exists = self.fs.exists(self.path)
            except (ImportError, ValueError) as error:
                raise RecipeError(f"--out {out!r}: {_first_line(error)}") from None
            except Exception as error:  # the filesystem's own: no network, no credentials
                raise RecipeError(
                    f"--out {out!r}: cannot reach it ({type(error).__name__}: {_first_line(error)})"
                ) from None
        else:
            exists = Path(out).exists()
        if exists:
            raise RecipeError(f"--out {out!r} already exists (choose another folder or delete it)")

    @contextmanager
    def local_folder(self) -> Iterator[Path]:
        """The folder to write: `out` itself, or (a URL) one in a temporary folder, removed afterwards."""
        if self.fs is None:
            yield Path(self.out)
            return
        staging = Path(tempfile.mkdtemp(prefix="prepare-"))
        try:
            yield staging / "out"
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def upload(self, folder: Path) -> None:
        """Copy a finished folder to the URL, the manifest last."""
        if self.fs is None:
            return
        names = [*sorted(path.name for path in folder.iterdir() if path.name != MANIFEST), MANIFEST]
        self.fs.makedirs(self.path, exist_ok=True)
        for name in names:
            self.fs.put_file(str(folder / name), f"{self.path.rstrip('/')}/{name}")


def _refuse_empty(sources: list[Source], inputs: list[str]) -> None:
    if not any(source.documents for source in sources):
        raise RecipeError(f"inputs {' '.join(inputs)}: {len(sources)} files but no non-empty document (empty input)")


def _write_folder(
    folder: Path,
    sources: list[Source],
    tokenizer: Tokenizer,
    text_field: str,
    val_fraction: float,
    parallel: Parallel,
    shard_tokens: int,
    show_progress: bool,
) -> dict[str, Any]:
    """Tokenizer, shards and the validation split into `folder`; the manifest (not yet written)."""
    tokenizer_text = tokenizer.to_str(pretty=True)
    (folder / TOKENIZER).write_bytes(tokenizer_text.encode("utf-8"))
    eos_token, eos = eos_id(tokenizer, "tokenizer")
    size = vocab_size(tokenizer)
    dtype = np.dtype(np.uint16 if size <= 1 << 16 else np.uint32)
    writer = ShardWriter(folder, dtype, shard_tokens)
    progress = Progress(sum(source.size for source in sources), enabled=show_progress)
    try:
        if parallel.engine == "ray":
            from {{ cookiecutter.package_name }}.tasks.language_model.data.distributed import encode_with_ray

            encode_with_ray(sources, text_field, tokenizer, eos, writer, parallel.tasks, progress)
        else:
            documents = iter_documents(sources, text_field, progress)
            encode_to_shards(documents, tokenizer, eos, writer, parallel.workers, progress)
    finally:
        progress.close()
    shards = writer.close()
    tokens = ShardedTokens([np.memmap(folder / shard["file"], dtype=dtype, mode="r") for shard in shards])
    boundary = validation_boundary(tokens, eos, val_fraction) if len(tokens) else 0
    return {
        "format": FORMAT,
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": hashlib.sha256(tokenizer_text.encode("utf-8")).hexdigest(),
            "vocab_size": size,
            "eos_token": eos_token,
            "eos_id": eos,
        },
        "dtype": dtype.name,
        "tokens": len(tokens),
        "documents": sum(source.documents for source in sources),
        "max_token_id": writer.max_token_id,
        "shards": shards,
        "validation": {
            "fraction": val_fraction,
            "first_token": boundary,
            "tokens": len(tokens) - boundary,
            "documents": count_token(tokens.view(boundary, len(tokens)), eos),
        },
        "text_field": text_field,
        "sources": [{"path": s.name(), "format": s.format, "bytes": s.size, "documents": s.documents} for s in sources],
    }
