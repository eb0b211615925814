"""What `prepare` reads: the input files, found in a fixed order, and their documents.

A document is a whole .txt file, the text field of a .jsonl line, or the text column of a .parquet
row or of an .arrow record (the files of a Hugging Face `datasets` folder written by
`save_to_disk`, in the order its state.json lists them). An input may be a URL (`hf://datasets/...`,
`s3://...`, any fsspec protocol): it is listed and read through fsspec, the same way.
"""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ....errors import RecipeError
from ....progress import Meter

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
SAVED_STATE, SAVED_SPLITS = "state.json", "dataset_dict.json"  # a save_to_disk Dataset's, a DatasetDict's


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
        raise RecipeError(f"input {item!r}: {first_line(error)}") from None
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
        raise RecipeError(f"input {item!r}: cannot list it ({type(error).__name__}: {first_line(error)})") from None


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


def first_line(error: BaseException) -> str:
    """An error's message in one line (the first), for a one-line refusal."""
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with source.open() as handle:
            if source.format == "parquet":
                return list(pq.read_schema(handle).names)
            return list(_arrow_batches(handle).schema.names)
    except pa.ArrowException as error:
        raise RecipeError(f"{source.name()}: not a readable .{source.format} file ({first_line(error)})") from None


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


class Progress(Meter):
    """`prepare`'s input bytes read, with the tokens written so far (which the writers add to `tokens`) in its lines."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.tokens = 0
        mib = total_bytes / 2**20
        super().__init__(
            "prepare",
            total_bytes,
            "B",
            lambda done: f"{done / 2**20:.0f} of {mib:.0f} MiB read, {self.tokens:,} tokens written",
            enabled,
        )
