"""`prepare --engine ray --tasks N`: tokenizing spread over a Ray cluster, the same folder byte for byte.

The input files are split into `tasks` contiguous runs, balanced by bytes (a file is never split:
a big corpus is many files). Each run is one Ray task that reads its files and returns their
token stream (in Ray's object store, spilled to disk when large) and the documents of each file.
The driver writes the streams in input order into the shards, hashes them and writes the
manifest, exactly as a one-machine `prepare` does: the output does not depend on the number of
tasks, nor on which machine ran which. The tokenizer is trained first on the driver (or given
with --tokenizer, the better choice for a corpus that one machine cannot read in good time).

`ray.init()` joins the cluster named by RAY_ADDRESS (or `ray start`'s on this node), else starts
one on this machine. Every node of the cluster needs this package installed, and every input
reachable: a URL (`s3://`, `hf://`, ...) or a path on a filesystem all nodes mount.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ....errors import RecipeError
from ....project import PROJECT
from .inputs import Progress, Source, iter_documents
from .prepared import TokenShardWriter
from .tokenizer import batches, encode_documents


def require_ray() -> None:
    """Refuse, before anything is read, an `--engine ray` where Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RecipeError(
            f"--engine ray needs Ray, which is not installed here (pip install '{PROJECT}[ray]')"
        ) from None


def split_sources(sources: list[Source], tasks: int) -> list[list[int]]:
    """Indices of the sources in at most `tasks` contiguous, non-empty runs of about equal bytes, in input order."""
    total = sum(max(source.size, 1) for source in sources)
    runs: list[list[int]] = []
    done = 0
    for index, source in enumerate(sources):
        # A run ends where the bytes so far pass the next multiple of total / tasks.
        if not runs or (len(runs) < tasks and done * tasks >= len(runs) * total):
            runs.append([])
        runs[-1].append(index)
        done += max(source.size, 1)
    return runs


def tokenize_run(
    sources: list[Source], text_field: str, tokenizer_json: str, eos: int, dtype: str
) -> tuple[np.ndarray, list[int]]:
    """One task: the token stream of these files (documents in order, each ended by EOS) and each file's documents."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task: the tasks are the parallelism
    tokenizer = Tokenizer.from_str(tokenizer_json)
    pieces = [encode_documents(tokenizer, batch, eos, dtype) for batch in batches(iter_documents(sources, text_field))]
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    return tokens, [source.documents for source in sources]


def encode_with_ray(
    sources: list[Source], text_field: str, tokenizer: Tokenizer, eos: int, writer: TokenShardWriter, tasks: int,
    progress: Progress,
) -> None:  # fmt: skip
    """Tokenize the sources in Ray tasks and write their streams in input order; counts each source's documents."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init()
    try:
        task = ray.remote(num_cpus=1)(tokenize_run)
        runs = split_sources(sources, tasks)
        ahead = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))  # bounded: the object store holds few results
        pending: deque[tuple[list[int], Any]] = deque()
        tokenizer_json = ray.put(tokenizer.to_str())
        for run in runs:
            # Local paths absolute: a task's working folder is not this one's (the manifest keeps them as given).
            files = [replace(sources[i], path=os.path.abspath(sources[i].path)) if sources[i].fs is None else sources[i]
                     for i in run]  # fmt: skip
            pending.append((run, task.remote(files, text_field, tokenizer_json, eos, writer.dtype.name)))
            if len(pending) > ahead:
                _write(sources, writer, progress, *pending.popleft())
        while pending:
            _write(sources, writer, progress, *pending.popleft())
    finally:
        if started:
            ray.shutdown()


def _write(sources: list[Source], writer: TokenShardWriter, progress: Progress, run: list[int], result: Any) -> None:
    import ray

    try:
        tokens, documents = ray.get(result)
    except ray.exceptions.RayTaskError as error:  # a bad record found by a task: its one line, not Ray's traceback
        if isinstance(error.cause, RecipeError):
            raise error.cause from None
        raise
    writer.write(tokens)
    progress.tokens += len(tokens)
    for index, count in zip(run, documents, strict=True):
        sources[index].documents = count
        progress.advance(sources[index].size)
