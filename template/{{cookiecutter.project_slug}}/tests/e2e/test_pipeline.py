"""Pipeline parallel (strategy.fsdp2.pipeline_*) as real multi-process runs on CPU (gloo).

Same seed, same global batch of 8 vectors: ddp (2 processes x 4) and a 2-stage pipeline (1 data-parallel
rank x 8, fed through in 4 pieces) are the same computation, so their losses agree to float rounding under
every schedule, and so do their validation losses (the same 16 held-out vectors, forward only through the
schedule on the pipeline). A stage keeps the whole model's parameter names, so its checkpoints resume without a
pipeline, under another pipeline degree (2 ranks of 2 stages <-> 4 ranks of 1), and back; a NaN that only the
last stage sees skips the update on every rank.
The machinery's own test: it trains the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    PIPELINE,
    assert_same_losses,
    final_weights,
    losses_by_run,
    read_csv_metrics,
    run_cli,
    toy_train_args,
    train_each_layout_once,
    train_losses,
)
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.slow

STEPS = 8
FOUR_BLOCKS = ["--model.depth", "4"]  # interleaved: 2 stages on each of 2 ranks, one block each
INTERLEAVED = [
    "--strategy.fsdp2.pipeline_schedule", "Interleaved1F1B", "--strategy.fsdp2.pipeline_stages_per_rank", "2",
]  # fmt: skip
# Zero-bubble: backward split into its input and weight halves; ZB-V holds stages 0 and 3 on rank 0, 1 and 2 on rank 1.
ZERO_BUBBLE = ["--strategy.fsdp2.pipeline_schedule", "InterleavedZeroBubble"]
ZBV = ["--strategy.fsdp2.pipeline_schedule", "ZBVZeroBubble", "--strategy.fsdp2.pipeline_stages_per_rank", "2"]
FOUR_PROCESSES = ["--devices", "4", "--train.micro_batch_size", "4", "--strategy.fsdp2.pipeline_microbatches", "2"]
HSDP = ["--strategy.name", "hsdp", "--num_nodes", "4", "--devices", "1", "--train.micro_batch_size", "4"]
# name -> (overrides of tests/toy-debug.yaml, nodes); every layout has a global batch of 8 vectors.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (["--strategy.name", "ddp"], 1),
    "pp_1f1b": (PIPELINE, 1),
    "pp_gpipe": ([*PIPELINE, "--strategy.fsdp2.pipeline_schedule", "GPipe"], 1),
    "ddp_4_blocks": (["--strategy.name", "ddp", *FOUR_BLOCKS], 1),
    "pp_interleaved": ([*PIPELINE, *FOUR_BLOCKS, *INTERLEAVED], 1),
    "pp_zero_bubble": ([*PIPELINE, *ZERO_BUBBLE], 1),
    "pp_zbv": ([*PIPELINE, *FOUR_BLOCKS, *ZBV], 1),
    # ZB-V over 2 data-parallel ranks a stage: its blocks stay gathered from forward to the weight half of backward.
    "pp_zbv_fsdp2": ([*PIPELINE, *FOUR_BLOCKS, *ZBV, *FOUR_PROCESSES], 1),
    # 4 processes: 2 stages x 2 data-parallel ranks (4 vectors each), or 2 stages x 2 tensor-parallel ranks.
    "pp_fsdp2": ([*PIPELINE, *FOUR_PROCESSES], 1),
    "pp_tp": ([*PIPELINE, "--devices", "4", "--strategy.fsdp2.tensor_parallel_size", "2"], 1),
    "pp4": ([*PIPELINE, *FOUR_BLOCKS, "--devices", "4", "--strategy.fsdp2.pipeline_parallel_size", "4"], 1),
    # 4 nodes of 1 process: each stage spans 2 nodes and hsdp replicates it across them (4 vectors each).
    "pp_hsdp": ([*PIPELINE, *HSDP, "--strategy.fsdp2.pipeline_microbatches", "2"], 4),
    "fsdp2": ([], 1),
}
SHARED = [
    "--train.max_steps", str(STEPS), "--eval.every_steps", "4", "--checkpoint.save_every_steps", "4",
    "--checkpoint.resume", "null",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> Callable[[str], Path]:
    """name -> out_dir of that layout's run; each layout trains once per test session."""
    return train_each_layout_once(tmp_path_factory, LAYOUTS, SHARED, toy_train_args, toy_source)


def validation_losses(out_dir: Path) -> dict[int, float]:
    """step -> logged validation loss."""
    return {int(row["step"]): float(row["val/loss"]) for row in read_csv_metrics(out_dir) if row.get("val/loss")}


@pytest.mark.parametrize(
    ("name", "reference", "last_stage"),
    [
        pytest.param("pp_1f1b", "ddp", "1", marks=pytest.mark.matrix),
        ("pp_zbv", "ddp_4_blocks", "0"),  # in a V the last stage shares rank 0 with the first
    ],
)
def test_pipeline_trains_and_validates_as_ddp_and_a_nan_on_its_last_stage_skips_every_rank(
    tmp_path: Path, toy_source: Path, name: str, reference: str, last_stage: str
) -> None:
    """Both runs see a NaN loss at step 3 on the rank of the pipeline's last stage (rank 1 under 1F1B, rank 0 under
    ZB-V): every rank skips that update, so the later steps and the validations at steps 4 and 8 still match; the
    pipeline's checkpoint holds the whole model under its own names."""
    runs = {}
    for run in (reference, name):
        out_dir = tmp_path / run
        overrides, _ = LAYOUTS[run]
        args = toy_train_args(out_dir, *SHARED, *overrides, "--train.on_nonfinite_loss", "skip")
        result = run_cli(*args, fault=f"nan-at-step:3:{last_stage}", source=toy_source)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "skipped" in result.stdout
        runs[run] = out_dir
    expected, actual = train_losses(runs[reference]), train_losses(runs[name])
    assert math.isnan(expected.pop(3)) and math.isnan(actual.pop(3))
    assert_same_losses(actual, expected, tolerance=1e-5)
    validated = validation_losses(runs[name])
    assert sorted(validated) == [4, 8]
    assert_same_losses(validated, validation_losses(runs[reference]), tolerance=1e-5)
    pipeline, replicated = final_weights(runs[name], STEPS), final_weights(runs[reference], STEPS)
    assert pipeline.keys() == replicated.keys()  # blocks.1.* stays blocks.1.* on the second stage
    for name, value in replicated.items():
        torch.testing.assert_close(pipeline[name], value, atol=1e-5, rtol=1e-4)


@pytest.mark.matrix
@pytest.mark.parametrize(
    ("pipeline", "reference"),
    [
        ("pp_1f1b", "ddp"),
        ("pp_gpipe", "ddp"),
        ("pp_interleaved", "ddp_4_blocks"),
        ("pp_zero_bubble", "ddp"),
        ("pp_zbv", "ddp_4_blocks"),
        ("pp_zbv_fsdp2", "ddp_4_blocks"),
        ("pp_fsdp2", "ddp"),
        ("pp_tp", "ddp"),
        ("pp4", "ddp_4_blocks"),
        ("pp_hsdp", "ddp"),
    ],
)
def test_pipeline_schedules_and_meshes_give_the_losses_of_ddp(
    trained: Callable[[str], Path], pipeline: str, reference: str
) -> None:
    assert_same_losses(train_losses(trained(pipeline)), train_losses(trained(reference)), tolerance=1e-5)
    assert_same_losses(validation_losses(trained(pipeline)), validation_losses(trained(reference)), tolerance=1e-5)


@pytest.mark.matrix
def test_hsdp_replicates_each_stage_across_the_nodes_it_spans(trained: Callable[[str], Path]) -> None:
    """pp=2 x hsdp on 4 nodes of 1 process: a stage's 2 ranks hold whole copies (replicate 2 x shard 1), so each
    tensor is saved in one piece; under pp=2 x fsdp2 the same 2 ranks hold, and save, half of it each."""

    def pieces(name: str) -> set[int]:
        state = trained(name) / "checkpoints" / f"step-{STEPS:08d}" / "state"
        metadata = FileSystemReader(state).read_metadata().state_dict_metadata
        return {len(entry.chunks) for key, entry in metadata.items() if key.startswith("model.")}  # type: ignore[union-attr]

    assert pieces("pp_hsdp") == {1}
    assert pieces("pp_fsdp2") == {2}


@pytest.mark.matrix
@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        ("pp_1f1b", "fsdp2"),
        ("fsdp2", "pp_1f1b"),
        ("pp_interleaved", "pp4"),
        ("pp4", "pp_interleaved"),
        ("pp_zbv", "pp_interleaved"),  # rank 0 held stages 0 and 3 (V), resumes holding 0 and 2 (loop)
    ],
)
def test_checkpoint_resumes_with_and_without_a_pipeline(
    tmp_path: Path, toy_source: Path, trained: Callable[[str], Path], saved_by: str, resumed_by: str
) -> None:
    checkpoint = trained(saved_by) / "checkpoints" / "step-00000004"
    overrides, _ = LAYOUTS[resumed_by]
    args = toy_train_args(tmp_path, *SHARED, *overrides, "--checkpoint.resume", str(checkpoint))
    result = run_cli(*args, source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {checkpoint} at step 4" in result.stdout
    (resumed,) = losses_by_run(tmp_path)
    expected = {step: loss for step, loss in train_losses(trained(saved_by)).items() if step > 4}
    assert_same_losses(resumed, expected, tolerance=1e-4)


@pytest.mark.matrix
def test_killed_pipeline_run_resumes_bitwise(tmp_path: Path, toy_source: Path, trained: Callable[[str], Path]) -> None:
    args = toy_train_args(tmp_path, *SHARED, *LAYOUTS["pp_1f1b"][0], "--checkpoint.resume", "auto")
    killed = run_cli(*args, fault="kill-at-step:6", source=toy_source)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*args, source=toy_source)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000004 at step 4" in resumed.stdout
    expected = train_losses(trained("pp_1f1b"))
    before_kill, after_resume = losses_by_run(tmp_path)
    assert before_kill == {step: expected[step] for step in range(1, 7)}  # floats compared exactly
    assert after_resume == {step: expected[step] for step in range(5, STEPS + 1)}
    weights, reference = final_weights(tmp_path, STEPS), final_weights(trained("pp_1f1b"), STEPS)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)
