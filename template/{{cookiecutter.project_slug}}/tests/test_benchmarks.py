"""The benchmarks run against the current code and print their side-by-side figures (tiny sizes: a run, not a measurement)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PROJECT, cli_env

pytestmark = pytest.mark.slow


def run_benchmark(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(PROJECT / "benchmarks" / name), *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_step_sync_benchmark_compares_the_fused_all_reduce_with_one_collective_per_decision() -> None:
    out = run_benchmark("step_sync.py", "--rounds", "1", "--steps", "2")
    rows = re.findall(r"^  (.+?)\s+([\d.]+) ms/step  = ([\d.]+)x the first$", out, re.MULTILINE)
    assert [name for name, _, _ in rows] == [
        "2 all_reduces (loss; signal)",
        "2 all_reduces + broadcast(bool)",
        "1 fused all_reduce (decide)",
    ], out
    assert float(rows[0][2]) == 1.0 and all(float(ms) > 0 for _, ms, _ in rows)


def test_checkpoint_io_benchmark_reports_save_load_and_disk_speed(tmp_path: Path) -> None:
    out = run_benchmark("checkpoint_io.py", "--n_layer", "1", "--n_embd", "64", "--dir", str(tmp_path))
    for row in ("bytes written per checkpoint", "disk sequential write (fsync)", "sync save", "async save", "load"):
        assert re.search(rf"^  {re.escape(row)}", out, re.MULTILINE), out
    assert re.search(r"sync save\s+[\d.]+ s = \d+ MiB/s = [\d.]+x disk", out), out
    assert (tmp_path / "checkpoints" / "step-00000001" / "meta.json").is_file()  # --dir keeps what it wrote
