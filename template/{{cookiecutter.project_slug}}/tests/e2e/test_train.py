"""End to end: real 2-process training on CPU (gloo) learns, writes checkpoints, and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import read_csv_metrics, run_cli, train_args, train_losses

pytestmark = pytest.mark.slow


def overrides(strategy: str, max_steps: int) -> list[str]:
    return [
        "--strategy.name", strategy, "--train.max_steps", str(max_steps),
        "--checkpoint.save_every_steps", "15", "--eval.every_steps", "15",
    ]  # fmt: skip


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_processes_learn_save_and_resume_from_the_saved_step(strategy: str, tmp_path: Path) -> None:
    out_dir = tmp_path / strategy
    first = run_cli(*train_args(out_dir, *overrides(strategy, 30)))
    assert first.returncode == 0, first.stderr[-3000:]

    losses = train_losses(out_dir)
    assert sorted(losses) == list(range(1, 31))
    start, end = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert end < 0.75 * start, f"loss did not fall: {start:.3f} -> {end:.3f}"
    assert any(row.get("val/loss") for row in read_csv_metrics(out_dir))

    checkpoint = out_dir / "checkpoints" / "step-00000030"
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == 30
    assert (out_dir / "checkpoints" / "step-00000015" / "meta.json").is_file()
    if strategy == "fsdp2":  # sharded: one file per rank plus metadata
        assert len(list((checkpoint / "state").glob("*.distcp"))) == 2
    else:
        assert (checkpoint / "state").is_file()
    assert not list((out_dir / "checkpoints").glob("*.partial"))

    second = run_cli(*train_args(out_dir, *overrides(strategy, 40)))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Resumed from {checkpoint} at step 30" in second.stdout
    resumed_rows = [row for row in read_csv_metrics(out_dir) if row.get("train/loss")][30:]
    assert [int(row["step"]) for row in resumed_rows] == list(range(31, 41))
    assert (out_dir / "checkpoints" / "step-00000040" / "meta.json").is_file()
    # It continues learning rather than starting over from a random model.
    assert float(resumed_rows[0]["train/loss"]) < 0.9 * start
