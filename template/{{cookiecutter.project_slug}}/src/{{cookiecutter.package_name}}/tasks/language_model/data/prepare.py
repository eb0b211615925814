"""`prepare`: .txt, .jsonl, .parquet files and saved datasets -> token shards, manifest.json and tokenizer.json.

    prepare data/raw --train_tokenizer 32000 --out data/prepared
    prepare 'data/raw/**/*.jsonl' --tokenizer tokenizer.json --text_field content --out data/prepared
    prepare hf://datasets/ORG/NAME/data --tokenizer tokenizer.json --out s3://bucket/prepared

The inputs and their documents: inputs.py. Documents are tokenized in input order, each followed by the tokenizer's end-of-document
token, and written to shards of `shard_tokens` tokens (uint16 when the vocabulary fits, else
uint32). Tokenizing runs in `workers` processes and the results are written in reading order, so
the same inputs give the same bytes whatever the number of workers. Everything is written to
`OUT.partial` and renamed to `OUT` after the manifest, so an interrupted prepare leaves nothing
that training accepts (see prepared.py for the folder's layout); an `--out` URL gets the finished
folder uploaded, its manifest last (Destination). `engine="ray"` tokenizes in Ray tasks instead of
local processes, with the same result (distributed.py).

`format="sft"` reads .jsonl chat records instead (chat.py) and writes them as examples with a loss
mask (sft.py), tokenized in this process; `--tokenizer` may then be a Hugging Face tokenizer folder,
whose chat template is used.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ....checkpoint.layout import new_partial, removed_unless_finished
from ....cluster.lifecycle import end_with_parent
from ....data.shards import write_manifest
from ....errors import RecipeError
from .chat import ChatTemplate, find_chat_template
from .inputs import (
    Progress,
    Source,
    check_text_field,
    find_inputs,
    first_line,
    iter_documents,
)
from .prepared import (
    FORMAT,
    MANIFEST,
    TASK,
    TOKENIZER,
    ShardedTokens,
    TokenShardWriter,
    count_token,
    validation_boundary,
)
from .sft import rendered_texts, sft_manifest, write_examples
from .tokenizer import (
    EOS_TOKEN,
    batches,
    encode_documents,
    eos_id,
    load_tokenizer,
    train_byte_level_bpe,
    vocab_size,
)

SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard: few files (each stays memory-mapped) even for 100B tokens
ENGINES = ("local", "ray")  # where tokenizing runs: processes on this machine, or Ray tasks (distributed.py)
FORMATS = ("text", "sft")  # documents of text -> a token stream; chat records -> examples with a loss mask


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_json: str, parent_pid: int) -> None:
    global _worker_tokenizer
    end_with_parent(parent_pid)  # a killed `prepare` leaves no worker behind
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str], eos: int, dtype: str) -> np.ndarray:
    """Token ids of the documents, each followed by the end-of-document id (runs in a worker process)."""
    assert _worker_tokenizer is not None
    return encode_documents(_worker_tokenizer, texts, eos, dtype)


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


def encode_to_shards(
    documents: Iterator[str], tokenizer: Tokenizer, eos: int, writer: TokenShardWriter, workers: int, progress: Progress
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


def _write(writer: TokenShardWriter, tokens: np.ndarray, progress: Progress) -> None:
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
    format: str = "text",
    chat_template: str | None = None,
) -> dict[str, Any]:
    """Tokenize the inputs into a prepared folder at `out` (a folder or a URL); return its manifest.

    Checks everything it can first. `engine="ray"` tokenizes in `tasks` Ray tasks (distributed.py);
    the folder is the same, byte for byte. `format="sft"`: chat records, `chat_template` "plain" or
    None (the tokenizer's own when it has one).
    """
    if format not in FORMATS:
        raise RecipeError(f"--format {format!r}: use one of {', '.join(FORMATS)}")
    if format == "sft" and engine != "local":
        raise RecipeError("--format sft tokenizes in this process: leave out --engine")
    if format != "sft" and chat_template is not None:
        raise RecipeError("--chat_template applies to --format sft only")
    tokenizer_folder = None if tokenizer_file is None else Path(tokenizer_file)  # where a chat template is looked for
    if tokenizer_folder is not None and format == "sft" and tokenizer_folder.is_dir():
        tokenizer_file = str(tokenizer_folder / TOKENIZER)
    if (tokenizer_file is None) == (train_tokenizer is None):
        raise RecipeError("prepare needs exactly one of --tokenizer tokenizer.json or --train_tokenizer VOCAB_SIZE")
    if not 0 < val_fraction < 1:
        raise RecipeError(f"--val_fraction {val_fraction:g} must be in (0, 1)")
    if engine not in ENGINES:
        raise RecipeError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "ray":
        if workers is not None:
            raise RecipeError("--workers counts the processes of --engine local; with --engine ray, use --tasks")
        from .distributed import require_ray

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
    if format == "text":
        check_text_field(sources, text_field)
    tokenizer = None if tokenizer_file is None else load_tokenizer(Path(tokenizer_file))
    eos_token = EOS_TOKEN if tokenizer is None else eos_id(tokenizer, f"--tokenizer {tokenizer_file!r}")[0]
    template = None
    if format == "sft":  # a trained tokenizer has no chat template: the plain one
        template = find_chat_template(tokenizer_folder, chat_template, eos_token)

    with destination.local_folder() as target:
        with removed_unless_finished(new_partial(target)) as partial:
            if tokenizer is None:
                texts = iter_documents(sources, text_field) if template is None else rendered_texts(sources, template)
                tokenizer = train_byte_level_bpe(texts, train_tokenizer or 0, progress and sys.stderr.isatty())
                _refuse_empty(sources, inputs)
            parallel = Parallel(engine, workers, tasks or len(sources))
            if template is None:
                manifest = _write_folder(
                    partial, sources, tokenizer, text_field, val_fraction, parallel, shard_tokens, progress
                )
            else:
                manifest = _write_sft_folder(
                    partial, sources, tokenizer, template, val_fraction, shard_tokens, progress
                )
            _refuse_empty(sources, inputs)
            manifest = {"task": TASK, **manifest}
            manifest["tokenizer"]["trained_on_inputs"] = train_tokenizer is not None
            write_manifest(partial, manifest)
            partial.rename(target)
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
                raise RecipeError(f"--out {out!r}: {first_line(error)}") from None
            except Exception as error:  # the filesystem's own: no network, no credentials
                raise RecipeError(
                    f"--out {out!r}: cannot reach it ({type(error).__name__}: {first_line(error)})"
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


def _write_sft_folder(
    folder: Path, sources: list[Source], tokenizer: Tokenizer, template: ChatTemplate, val_fraction: float,
    shard_tokens: int, show_progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Tokenizer, token and loss-mask shards, example offsets and the validation split; the manifest (not written)."""
    manifest, dtype = _tokenizer_part(folder, tokenizer)
    writers = (
        TokenShardWriter(folder, dtype, shard_tokens),
        TokenShardWriter(folder, np.dtype(np.uint8), shard_tokens, "mask"),
    )
    progress = Progress(sum(source.size for source in sources), enabled=show_progress)
    try:
        offsets, loss_tokens = write_examples(folder, sources, tokenizer, template, writers, progress)
    finally:
        progress.close()
    shards, masks = writers[0].close(), writers[1].close()
    return {
        **manifest,
        "tokens": int(offsets[-1]),
        "documents": len(offsets) - 1,
        "max_token_id": writers[0].max_token_id,
        "shards": shards,
        **sft_manifest(offsets, loss_tokens, masks, template, val_fraction),
        "sources": [{"path": s.name(), "format": s.format, "bytes": s.size, "documents": s.documents} for s in sources],
    }


def _tokenizer_part(folder: Path, tokenizer: Tokenizer) -> tuple[dict[str, Any], np.dtype]:
    """Write tokenizer.json; the manifest's format, tokenizer and dtype, and the dtype of the token shards."""
    tokenizer_text = tokenizer.to_str(pretty=True)
    (folder / TOKENIZER).write_bytes(tokenizer_text.encode("utf-8"))
    eos_token, eos = eos_id(tokenizer, "tokenizer")
    size = vocab_size(tokenizer)
    dtype = np.dtype(np.uint16 if size <= 1 << 16 else np.uint32)
    tokenizer_entry = {
        "file": TOKENIZER,
        "sha256": hashlib.sha256(tokenizer_text.encode("utf-8")).hexdigest(),
        "vocab_size": size,
        "eos_token": eos_token,
        "eos_id": eos,
    }
    return {"format": FORMAT, "tokenizer": tokenizer_entry, "dtype": dtype.name}, dtype


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
    manifest, dtype = _tokenizer_part(folder, tokenizer)
    eos = manifest["tokenizer"]["eos_id"]
    writer = TokenShardWriter(folder, dtype, shard_tokens)
    progress = Progress(sum(source.size for source in sources), enabled=show_progress)
    try:
        if parallel.engine == "ray":
            from .distributed import encode_with_ray

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
        **manifest,
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
