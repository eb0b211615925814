"""`prepare` throughput with 1 and N workers against the tokenizer's own `encode_batch` of the same text, in one run.

    python benchmarks/prepare_throughput.py                      # ~32 MiB of .jsonl, a 4096-token BPE
    python benchmarks/prepare_throughput.py --megabytes 256 --workers 1 2 4 8

`encode_batch` (all cores, Rust threads, text already in memory) is what tokenizing costs at the
least; `prepare` also reads and parses the files, writes and hashes the shards, and ships text to
its worker processes. The ratio says how much of the tokenizer's speed survives all that (target
>= 0.8). Variants alternate over rounds so that drift of the machine hits all alike; the figures
are each variant's best round. CPU seconds (all threads and worker processes) show the cost apart
from how many cores were free. Also printed: what the sampler costs per optimizer step on the
prepared shards (the loop's data wait), for a GPU-sized batch.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.data.sampler import TrainBatches
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import open_prepared
from {{ cookiecutter.package_name }}.tasks.language_model.data.tokenizer import train_byte_level_bpe
from {{ cookiecutter.package_name }}.tasks.language_model.data.windows import TokenWindows


def make_documents(megabytes: float, seed: int = 0) -> list[str]:
    """English-like documents of varied words, numbers and punctuation (a few hundred to a few thousand characters)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "sta", "to", "ve", "qui", "dor", "an", "el", "is", "ur", "ph", "th", "ing"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(20_000)]
    documents, size = [], 0
    while size < megabytes * 2**20:
        sentences = []
        for _ in range(rng.randint(3, 40)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 18)))
            if rng.random() < 0.3:
                sentence += f" {rng.randint(0, 10**6)}"
            sentences.append(sentence.capitalize() + rng.choice([".", ".", "!", "?", ";"]))
        documents.append(" ".join(sentences))
        size += len(documents[-1])
    return documents


def cpu_seconds() -> float:
    """CPU time of this process's threads and of its finished child processes."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=32.0, help="Text to tokenize.")
    parser.add_argument("--vocab", type=int, default=4096, help="Size of the BPE trained for the benchmark.")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="prepare --workers values.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=2048, help="Sampler: sequence length.")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="Sampler: sequences per micro-batch.")
    parser.add_argument("--grad_accum_steps", type=int, default=4, help="Sampler: micro-batches per step.")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="prepare-throughput-"))
    try:
        documents = make_documents(args.megabytes)
        text_bytes = sum(len(doc.encode("utf-8")) for doc in documents)
        with (folder / "input.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": doc}) + "\n" for doc in documents)
        tokenizer = train_byte_level_bpe(documents[: max(1, len(documents) // 8)], args.vocab)
        tokenizer.save(str(folder / "tokenizer.json"))
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

        best: dict[str, tuple[float, float]] = {}  # variant -> (wall seconds, CPU seconds) of its best round
        tokens: dict[str, int] = {}

        def record(name: str, started: float, cpu_started: float) -> None:
            measured = (time.perf_counter() - started, cpu_seconds() - cpu_started)
            best[name] = min(best.get(name, measured), measured)

        for round_ in range(args.rounds):
            for method in ("encode_batch", "encode_batch_fast"):
                if hasattr(tokenizer, method):
                    started, cpu_started = time.perf_counter(), cpu_seconds()
                    encodings = getattr(tokenizer, method)(documents, add_special_tokens=False)
                    record(method, started, cpu_started)
                    tokens[method] = sum(len(e.ids) + 1 for e in encodings)  # + 1: prepare's end-of-document token
                    del encodings
            for workers in args.workers:
                out = folder / f"out-{workers}-{round_}"
                started, cpu_started = time.perf_counter(), cpu_seconds()
                manifest = prepare([str(folder / "input.jsonl")], str(out), str(folder / "tokenizer.json"),
                                   workers=workers, progress=False)  # fmt: skip
                record(f"prepare --workers {workers}", started, cpu_started)
                tokens[f"prepare --workers {workers}"] = manifest["tokens"]
                if round_ < args.rounds - 1:
                    shutil.rmtree(out)

        print(f"{text_bytes / 2**20:.1f} MiB of text in {len(documents):,} documents, BPE of {args.vocab} tokens;"
              f" best of {args.rounds} rounds")  # fmt: skip
        reference = text_bytes / best["encode_batch"][0]
        for name, (seconds, cpu) in best.items():
            speed = text_bytes / seconds
            print(f"  {name:<22} {speed / 2**20:7.2f} MiB/s  {tokens[name] / seconds / 1e6:6.2f} M tokens/s"
                  f"  = {speed / reference:.2f}x encode_batch   {cpu:6.1f} CPU s")  # fmt: skip
        assert len(set(tokens.values())) == 1, f"token counts differ: {tokens}"

        out = folder / f"out-{args.workers[-1]}-{args.rounds - 1}"
        shards, _ = open_prepared(out)
        windows = TokenWindows(shards, args.block_size)
        batches = TrainBatches(windows, args.micro_batch_size, args.grad_accum_steps, 0, 1, seed=0)
        steps = max(1, min(200, batches.num_samples // (args.micro_batch_size * args.grad_accum_steps)))
        started = time.perf_counter()
        for _ in range(steps):
            batches.next_step()
        per_step = (time.perf_counter() - started) / steps
        step_tokens = args.block_size * args.micro_batch_size * args.grad_accum_steps
        print(f"  sampler: {per_step * 1e3:.2f} ms per step of {args.grad_accum_steps} x {args.micro_batch_size}"
              f" x {args.block_size} tokens = {step_tokens / per_step / 1e6:.1f} M tokens/s per process")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
