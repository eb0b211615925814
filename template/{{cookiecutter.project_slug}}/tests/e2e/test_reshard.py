"""A checkpoint resumes on another process count or strategy, continuing from the same step with matching loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import losses_by_run, run_cli, train_args

pytestmark = pytest.mark.slow

# Same global batch in every layout: 2 processes x 4 sequences, or 1 process x 4 sequences x 2 micro-batches.
LAYOUTS = {
    "fsdp2-2": ["--strategy.name", "fsdp2", "--devices", "2", "--train.grad_accum_steps", "1"],
    "fsdp2-1": ["--strategy.name", "fsdp2", "--devices", "1", "--train.grad_accum_steps", "2"],
    "ddp-2": ["--strategy.name", "ddp", "--devices", "2", "--train.grad_accum_steps", "1"],
    "ddp-1": ["--strategy.name", "ddp", "--devices", "1", "--train.grad_accum_steps", "2"],  # no DDP wrapper
}


SHARED = ["--train.max_steps", "12", "--checkpoint.save_every_steps", "8", "--eval.every_steps", "0"]


@pytest.fixture(scope="module")
def source_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted 12-step run per layout, made when a test first asks for it; its step-8 checkpoint is what the
    others resume from."""

    class Runs(dict[str, Path]):
        def __missing__(self, layout: str) -> Path:
            out_dir = tmp_path_factory.mktemp(layout)
            result = run_cli(*train_args(out_dir, *LAYOUTS[layout], *SHARED))
            assert result.returncode == 0, result.stderr[-3000:]
            self[layout] = out_dir
            return out_dir

    return Runs()


# CI runs the first three (two source runs: a sharded checkpoint on one process, a DDP one sharded, a sharded one
# into a bare module); the rest repeat them from other sources.
@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        ("fsdp2-2", "fsdp2-1"),
        ("ddp-2", "fsdp2-2"),
        ("fsdp2-2", "ddp-1"),
        pytest.param("fsdp2-1", "fsdp2-2", marks=pytest.mark.matrix),
        pytest.param("fsdp2-2", "ddp-2", marks=pytest.mark.matrix),
        pytest.param("ddp-1", "fsdp2-2", marks=pytest.mark.matrix),
        pytest.param("ddp-1", "ddp-2", marks=pytest.mark.matrix),
    ],
)
def test_checkpoint_continues_in_another_layout(
    tmp_path: Path, source_runs: dict[str, Path], saved_by: str, resumed_by: str
) -> None:
    checkpoint = source_runs[saved_by] / "checkpoints" / "step-00000008"
    result = run_cli(*train_args(tmp_path, *LAYOUTS[resumed_by], *SHARED, "--checkpoint.resume", str(checkpoint)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {checkpoint} at step 8" in result.stdout

    (expected,) = losses_by_run(source_runs[saved_by])
    (resumed,) = losses_by_run(tmp_path)
    assert sorted(resumed) == [9, 10, 11, 12]
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step
    meta = json.loads((tmp_path / "checkpoints" / "step-00000012" / "meta.json").read_text())
    assert meta["strategy"] == resumed_by.split("-")[0] and meta["world_size"] == int(resumed_by.split("-")[1])
