"""The language model's benchmarks (benchmarks/: the loop, checkpoints and data timed on its GPT and token shards)
run against the current code (tiny sizes: a run, not a measurement; no timing is asserted), and what they count
rather than time holds: host syncs per step, FSDP2's share of the training state."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PROJECT, cli_env

pytestmark = pytest.mark.slow

KEYS = {
    "loop_vs_handwritten_eager",
    "loop_vs_handwritten_compiled",
    "compile_gain_ratio",
    "fsdp2_state_vs_ddp",
    "scaling_2x1_vs_1x1",
    "save_vs_disk",
    "async_blocked_vs_sync",
    "async_blocked_vs_memory_copy",
    "startup_vs_import",
    "startup_early_ranks_vs_fabric",
    "first_step_16gb_vs_1gb",
    "first_step_verify_full_vs_sizes",
    "host_syncs_per_step",
    "pipeline_step_vs_ddp",
    "pipeline_predicted_step_vs_ddp",
    "pipeline_zbv_step_vs_ddp",
    "pipeline_zbv_predicted_step_vs_ddp",
    "fused_decide_vs_per_decision",
    "profile_other_steps_vs_off",
    "adamw_vs_previous_default",
    "selective_ac_held_vs_none",
    "selective_ac_step_vs_full",
    "cache_cold_vs_local",
    "cache_warm_vs_local",
    "goodput_no_failures",
    "goodput_with_failures",
    "goodput_failures_vs_none",
    "moe_ep2_step_vs_ep1",
    "moe_grouped_vs_loop",
    "cp2_held_vs_cp1",
    "cp2_step_vs_cp1",
}


def run_benchmark(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(PROJECT / "benchmarks" / name), *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.matrix  # every benchmark of run.py once, tiny (minutes); CI runs two of them on their own below
def test_run_quick_prints_one_table_and_writes_every_ratio_with_its_spread(tmp_path: Path) -> None:
    out = run_benchmark("run.py", "--quick", "--out", str(tmp_path / "latest.json"))
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report.keys() >= KEYS | {"command", "date", "machine"}, report.keys()
    for key in KEYS:
        figure = report[key]
        assert figure["min"] <= figure["median"] <= figure["max"] and figure["median"] > 0, (key, figure)
        assert re.search(rf"^{key}\s+[\d.]+\s+[\d.]+\.\.[\d.]+", out, re.MULTILINE), out
    # Counted, not timed: the loop waits for the device at most once per step outside logging steps.
    assert report["host_syncs_per_step"]["max"] <= 1, report["host_syncs_per_step"]
    # FSDP2 on 2 processes holds about half of ddp's parameters, gradients and optimizer state per rank.
    assert report["fsdp2_state_vs_ddp"]["median"] <= 0.52, report["fsdp2_state_vs_ddp"]
    # Counted: selective checkpointing holds less for backward than none, and more than full checkpointing.
    assert report["full_ac_held_vs_none"]["median"] < report["selective_ac_held_vs_none"]["median"] < 1, report


def test_step_sync_benchmark_compares_the_fused_all_reduce_with_one_collective_per_decision() -> None:
    out = run_benchmark("step_sync.py", "--rounds", "1", "--steps", "2")
    rows = re.findall(r"^  (.+?)\s+([\d.]+) ms/step  = ([\d.]+)x the first$", out, re.MULTILINE)
    assert [name for name, _, _ in rows] == [
        "2 all_reduces (loss; signal)",
        "2 all_reduces + broadcast(bool)",
        "1 fused all_reduce (decide)",
        "1 fused + barrier (Fabric's)",
    ], out
    assert float(rows[0][2]) == 1.0 and all(float(ms) > 0 for _, ms, _ in rows)


def test_checkpoint_io_benchmark_reports_save_load_disk_speed_and_memory_copy(tmp_path: Path) -> None:
    out = run_benchmark("checkpoint_io.py", "--n_layer", "1", "--n_embd", "64", "--dir", str(tmp_path))
    rows = ("bytes written per checkpoint", "disk sequential write (fsync)", "memory copy", "sync save", "async save")
    for row in (*rows, "load"):
        assert re.search(rf"^  {re.escape(row)}", out, re.MULTILINE), out
    assert re.search(r"sync save\s+[\d.]+ s = \d+ MiB/s = [\d.]+x disk", out), out
    assert re.search(r"loop blocked\s+[\d.]+ s = [\d.]+x sync save = [\d.]+x memory copy", out), out
    assert (tmp_path / "checkpoints" / "step-00000002" / "meta.json").is_file()  # --dir keeps what it wrote


def test_moe_benchmark_times_grouped_gemm_and_the_loop_on_the_same_skewed_rows(tmp_path: Path) -> None:
    run_benchmark("moe.py", "--quick", "--json", str(tmp_path / "moe.json"))
    result = json.loads((tmp_path / "moe.json").read_text())
    assert result["tokens_per_second"].keys() == {"grouped", "loop"}
    assert all(len(values) == 1 and values[0] > 0 for values in result["tokens_per_second"].values()), result
    shape = result["shape"]  # skewed: the busiest expert takes more than an even share of the rows
    assert 1 / shape["experts"] < shape["largest_expert_share"] < 1, shape
