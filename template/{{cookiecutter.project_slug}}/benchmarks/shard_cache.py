"""Data wait per step: a prepared folder read through the shard cache from S3, cold and warm, against the same
folder read locally.

The S3 API is moto's server on localhost (started here): the figure is the cost of the cache's path (the
fetch, the digest, the rename, the memory map of the cached copy) and of the order's fetch-ahead, not of a
real network. Each step reads `micro_batch_size` windows with the shard-block order, then sleeps
`--step_ms` as a device step would (the background fetch runs meanwhile). The three variants alternate in
every repeat: local (memory maps of the folder), cold (an empty cache), warm (the cache the cold run filled,
big enough to hold the corpus).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from {{ cookiecutter.package_name }}.data.remote import CachedShards, ShardCache
from {{ cookiecutter.package_name }}.data.sampler import TrainBatches
from {{ cookiecutter.package_name }}.data.shards import Listed
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import ShardedTokens
from {{ cookiecutter.package_name }}.tasks.language_model.data.windows import TokenWindows


def write_shards(folder: Path, shards: int, shard_tokens: int) -> list[Listed]:
    """Random uint16 token shards; the files as a manifest lists them."""
    rng = np.random.default_rng(0)
    files = []
    for index in range(shards):
        data = rng.integers(0, 50000, shard_tokens, dtype=np.uint16).tobytes()
        name = f"shard-{index:05d}.bin"
        (folder / name).write_bytes(data)
        files.append(Listed(name, len(data), hashlib.sha256(data).hexdigest()))
    return files


def data_wait(tokens: ShardedTokens, args: argparse.Namespace) -> float:
    """Mean seconds per step spent reading the step's windows, with a device step of `step_ms` after each."""
    batches = TrainBatches(TokenWindows(tokens, args.window, args.group), args.micro, 1, 0, 1, seed=0)
    waited = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        batches.next_step()
        waited += time.perf_counter() - start
        time.sleep(args.step_ms / 1000)
    return waited / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.shards, args.shard_tokens = (8, 1 << 16) if args.quick else (32, 1 << 21)  # 4 MiB shards: 128 MiB
    args.window, args.micro, args.group, args.step_ms = 1024, 8, 2, 20
    args.steps = 40 if args.quick else 300  # 300 steps of 8 windows: 1.2 shards of 2048 windows ... a few groups

    import s3fs

    tests = Path(__file__).resolve().parents[1] / "tests" / "tasks" / "language_model"
    sys.path.insert(0, str(tests))  # moto's server, as the tests start it
    from s3 import s3_server

    waits: dict[str, list[float]] = {"local": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp, s3_server() as endpoint:
        root = Path(tmp)
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        (root / "local").mkdir()
        files = write_shards(root / "local", args.shards, args.shard_tokens)
        s3 = s3fs.S3FileSystem(skip_instance_cache=True)
        s3.mkdir("bench")
        s3.put(f"{root / 'local'}/", "bench/corpus/", recursive=True)
        lengths = [args.shard_tokens] * args.shards
        local = ShardedTokens([np.memmap(root / "local" / f.name, dtype=np.uint16, mode="r") for f in files])
        bound = 2 * args.shards * args.shard_tokens * 2
        for repeat in range(args.repeats):
            cache = root / f"cache-{repeat}"
            variants = ["local", "cold", "warm"] if repeat % 2 == 0 else ["cold", "warm", "local"]
            for variant in variants:
                if variant == "local":
                    tokens = local
                else:  # warm: a new reader of the cache the cold run of this repeat filled
                    shards = CachedShards(ShardCache("s3://bench/corpus", cache, bound), files, np.uint16)
                    tokens = ShardedTokens(shards, lengths=lengths, dtype=np.uint16)
                waits[variant].append(data_wait(tokens, args))
                print(
                    f"  repeat {repeat + 1}/{args.repeats} {variant}: {waits[variant][-1] * 1e3:.3f} ms",
                    file=sys.stderr,
                )
    ratio = lambda a, b: [x / y for x, y in zip(waits[a], waits[b], strict=True)]  # noqa: E731
    result = {
        "cold_vs_local": ratio("cold", "local"),
        "warm_vs_local": ratio("warm", "local"),
        "seconds_per_step": waits,
        "shards": args.shards,
        "shard_bytes": args.shard_tokens * 2,
        "steps": args.steps,
        "step_ms": args.step_ms,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: statistics.median(value) for key, value in result.items() if key.endswith("local")}))


if __name__ == "__main__":
    main()
