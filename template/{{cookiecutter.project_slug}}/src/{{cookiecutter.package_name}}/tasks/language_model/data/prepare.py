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
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard: few files (each stays memory-mapped) even for 100B tokens
BATCH_CHARS = 1 << 20  # text per task sent to a worker: large enough that the transfer costs little
LOG_EVERY_SECONDS = 10.0


@dataclass
class Source:
    """One input file and what was read from it."""

    path: Path
    format: str
    documents: int = 0


def find_inputs(inputs: list[str]) -> list[Source]:
    """The input files, in a fixed order: each folder's files sorted, globs sorted, duplicates dropped."""
    found: dict[Path, None] = {}
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.suffix in FORMATS and p.is_file())
        elif path.is_file():
            matches = [path]
        else:
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise RecipeError(f"input {item!r}: no such file or folder, and no file matches it as a glob")
        for match in matches:
            if match.suffix not in FORMATS:
                raise RecipeError(f"input {str(match)!r}: unsupported file type (use {', '.join(FORMATS)})")
            found[match] = None
    if not found:
        raise RecipeError(f"inputs {' '.join(inputs)}: no {', '.join(FORMATS)} files found (empty input)")
    return [Source(path, FORMATS[path.suffix]) for path in found]


def check_text_field(sources: list[Source], text_field: str) -> None:
    """Refuse, before anything is written, a .parquet file without the text column or a .jsonl whose first record lacks it."""
    import pyarrow.parquet as pq

    for source in sources:
        if source.format == "parquet":
            columns = pq.read_schema(source.path).names
            if text_field not in columns:
                raise RecipeError(
                    f"{source.path}: no column {text_field!r} (columns: {', '.join(columns)}; choose with --text_field)"
                )
        elif source.format == "jsonl":
            with source.path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        _text_of(line, source.path, number, text_field)
                        break


def _text_of(line: str, path: Path, number: int, text_field: str) -> str:
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
    if source.format == "txt":
        text = source.path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text, source.path.stat().st_size
    elif source.format == "jsonl":
        with source.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip() and (text := _text_of(line, source.path, number, text_field)):
                    yield text, len(line)
    else:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(source.path)
        bytes_per_row = source.path.stat().st_size / max(parquet.metadata.num_rows, 1)
        for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text, int(bytes_per_row)


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
    # encode_batch_fast (tokenizers >= 0.21) gives the same ids without computing character offsets.
    encode = getattr(_worker_tokenizer, "encode_batch_fast", _worker_tokenizer.encode_batch)
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


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
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
        for batch in _batches(documents):
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
) -> dict[str, Any]:
    """Tokenize the inputs into a prepared folder at `out`; return its manifest. Checks everything it can first."""
    if (tokenizer_file is None) == (train_tokenizer is None):
        raise RecipeError("prepare needs exactly one of --tokenizer tokenizer.json or --train_tokenizer VOCAB_SIZE")
    if not 0 < val_fraction < 1:
        raise RecipeError(f"--val_fraction {val_fraction:g} must be in (0, 1)")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers < 1 or shard_tokens < 1:
        raise RecipeError(f"--workers {workers} and --shard_tokens {shard_tokens} must be >= 1")
    target = Path(out)
    if target.exists():
        raise RecipeError(f"--out {out!r} already exists (choose another folder or delete it)")
    sources = find_inputs(inputs)
    total_bytes = sum(source.path.stat().st_size for source in sources)
    if total_bytes == 0:
        raise RecipeError(f"inputs {' '.join(inputs)}: all {len(sources)} files are empty (empty input)")
    check_text_field(sources, text_field)
    tokenizer = None if tokenizer_file is None else load_tokenizer(Path(tokenizer_file))
    if tokenizer is not None:
        eos_id(tokenizer, f"--tokenizer {tokenizer_file!r}")

    partial = new_partial(target)
    try:
        if tokenizer is None:
            tokenizer = train_byte_level_bpe(
                iter_documents(sources, text_field), train_tokenizer or 0, progress and sys.stderr.isatty()
            )
            _refuse_empty(sources, inputs)
        manifest = _write_folder(partial, sources, tokenizer, text_field, val_fraction, workers, shard_tokens, progress)
        _refuse_empty(sources, inputs)
        manifest["tokenizer"]["trained_on_inputs"] = train_tokenizer is not None
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _refuse_empty(sources: list[Source], inputs: list[str]) -> None:
    if not any(source.documents for source in sources):
        raise RecipeError(f"inputs {' '.join(inputs)}: {len(sources)} files but no non-empty document (empty input)")


def _write_folder(
    folder: Path,
    sources: list[Source],
    tokenizer: Tokenizer,
    text_field: str,
    val_fraction: float,
    workers: int,
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
    progress = Progress(sum(source.path.stat().st_size for source in sources), enabled=show_progress)
    try:
        encode_to_shards(iter_documents(sources, text_field, progress), tokenizer, eos, writer, workers, progress)
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
        "sources": [
            {"path": str(s.path), "format": s.format, "bytes": s.path.stat().st_size, "documents": s.documents}
            for s in sources
        ],
    }
