"""The prepare throughput benchmark runs against the current code and prints its figures (tiny size: a run, not a measurement)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import PROJECT, cli_env


def test_prepare_benchmark_compares_workers_with_encode_batch() -> None:
    result = subprocess.run(
        [sys.executable, str(PROJECT / "benchmarks" / "prepare_throughput.py"), "--megabytes", "0.3",
         "--vocab", "300", "--rounds", "1", "--block_size", "16"],
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = dict(
        re.findall(r"^  (\S+(?: --workers \d+)?)\s+[\d.]+ MiB/s .* = ([\d.]+)x encode_batch", result.stdout, re.M)
    )
    assert rows.keys() >= {"encode_batch", "prepare --workers 1", "prepare --workers 2"}, result.stdout
    assert float(rows["encode_batch"]) == 1.0
    assert re.search(r"sampler: [\d.]+ ms per step", result.stdout), result.stdout
