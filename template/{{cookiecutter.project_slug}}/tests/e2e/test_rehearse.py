"""`rehearse`: a recipe's run built rank by rank on torch's fake process group with fake tensors, one optimizer step
each, on this machine whatever the run's size; what would fail at launch is refused in one line before any rank
starts.

The machinery's own test: it rehearses the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import TOY_RECIPE, fail_with, run_cli
from toy_task.config import MlpConfig

# 64 ranks: 8 nodes of 8, the toy MLP 256 wide, so that most of its matrices split evenly over them and the head's
# 4 rows do not.
NODES, DEVICES, WIDTH = 8, 8, 256
LAYOUT = ["--num_nodes", str(NODES), "--devices", str(DEVICES), "--model.width", str(WIDTH)]


def shapes(config: MlpConfig) -> list[tuple[int, ...]]:
    """The toy MLP's parameter shapes, in its modules' order."""
    w = config.width
    block = [(w,), (w,), (2 * w, w), (2 * w,), (w, 2 * w), (w,)]  # norm, fc, proj
    return [(w, config.inputs), (w,), *block * config.depth, (config.outputs, w), (config.outputs,)]


def fully_shard_elements(shape: tuple[int, ...], rank: int, ranks: int) -> int:
    """Elements of a parameter rank `rank` holds under fully_shard: whole rows, ceil(rows / ranks) each, in order."""
    rows = shape[0]
    chunk = math.ceil(rows / ranks)
    held = max(0, min(rows - rank * chunk, chunk))
    return held * math.prod(shape[1:])


@pytest.fixture(scope="module")
def rehearsal(toy_source: Path) -> dict:
    """The toy recipe rehearsed on 64 ranks under fsdp2: its default ranks, as JSON."""
    result = run_cli("rehearse", str(TOY_RECIPE), *LAYOUT, "--json", source=toy_source)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_first_and_last_of_64_ranks_hold_the_shards_fully_shard_gives_them(rehearsal: dict) -> None:
    ranks = NODES * DEVICES
    assert rehearsal["world_size"] == ranks
    assert [rank["rank"] for rank in rehearsal["ranks"]] == [0, ranks - 1]
    config = MlpConfig(width=WIDTH)
    for rank in rehearsal["ranks"]:
        assert rank["mesh"] == {"data_parallel": rank["rank"], "tensor_parallel": 0}
        held = 4 * sum(fully_shard_elements(shape, rank["rank"], ranks) for shape in shapes(config))
        assert rank["parameters_bytes"] == held  # fp32 shards (32-true)
        assert rank["gradients_bytes"] == held  # reduce-scattered into the same shards
        assert rank["optimizer_bytes"] == 2 * held  # AdamW's two moments
    # plan spreads every parameter evenly; whole rows leave the head's 4 rows on the first 4 ranks only
    first, last = rehearsal["ranks"]
    total = 4 * sum(math.prod(shape) for shape in shapes(config))
    assert rehearsal["plan"]["parameters_bytes"] == pytest.approx(total / ranks)
    assert first["parameters_bytes"] > rehearsal["plan"]["parameters_bytes"] > last["parameters_bytes"]


@pytest.mark.slow
def test_one_step_issues_the_collectives_of_fully_shard_per_block_that_plan_counts(rehearsal: dict) -> None:
    """One micro-batch: each block gathered in forward and again in backward, the root once (kept for the step);
    one reduce-scatter per block and the root; one all-reduce for the step decision."""
    depth = MlpConfig().depth
    assert rehearsal["plan"]["collectives"] == {"allgather": 2 * depth + 1, "reduce_scatter": depth + 1, "allreduce": 1}
    for rank in rehearsal["ranks"]:
        counts = rank["collectives"]
        assert {name: counts[name] for name in rehearsal["plan"]["collectives"]} == rehearsal["plan"]["collectives"]
        assert rank["peak_bytes"] > rank["parameters_bytes"] + rank["gradients_bytes"] + rank["optimizer_bytes"]


@pytest.mark.slow
def test_hsdp_reduce_scatters_every_micro_batch_and_all_reduces_across_replicas_once_a_step(toy_source: Path) -> None:
    """Gradient accumulation keeps no unsharded gradient: each micro-batch's gradients are reduce-scattered into the
    shards, and only the replicas' all-reduce of the shards waits for the step's last micro-batch."""
    accumulate, depth = 3, MlpConfig().depth
    hsdp = ["--strategy.name", "hsdp", "--train.grad_accum_steps", str(accumulate), "--ranks", "0", "--json"]
    result = run_cli("rehearse", str(TOY_RECIPE), *LAYOUT, *hsdp, source=toy_source)
    assert result.returncode == 0, result.stderr
    rehearsal = json.loads(result.stdout)
    (rank,) = rehearsal["ranks"]
    counts = {name: rank["collectives"][name] for name in ("allgather", "reduce_scatter", "allreduce")}
    expected = {
        "allgather": accumulate * (2 * depth + 1),
        "reduce_scatter": accumulate * (depth + 1),
        "allreduce": depth + 1 + 1,  # each block's and the root's shard across the replicas, and the step decision
    }
    assert counts == expected == rehearsal["plan"]["collectives"]
    # No unsharded gradient outlives its block's reduce-scatter: holding them all until the last micro-batch would
    # add 4 bytes per parameter of the model (twice plan's peak here); fully_shard's copy-in and copy-out buffers
    # of one block, which plan leaves out, stay under a third of it.
    assert rank["peak_bytes"] < 1.3 * rehearsal["plan"]["peak_bytes"]


@pytest.mark.slow
def test_a_peak_above_the_devices_memory_is_refused_in_one_line(toy_source: Path) -> None:
    small = ["--gpu_memory_gib", "0.001", "--ranks", "0"]
    result = run_cli("rehearse", str(TOY_RECIPE), *LAYOUT, *small, source=toy_source)
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: rank 0 peaks at ") and "would run out of memory" in last_line
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("toy_task_here")
@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["--ranks", "64"], "--ranks=64: each rank must be in [-64, 63]"),
        (["--ranks", "first"], "--ranks=first: expected integers"),
        (["--strategy.fsdp2.tensor_parallel_size", "3"], "tensor_parallel_size=3 does not divide devices=8"),
        (["--strategy.fsdp2.tensor_parallel_size", "16"], "tensor_parallel_size=16 does not divide devices=8"),
        (["--accelerator", "cuda", "--strategy.name", "deepspeed"], "strategy.name=deepspeed: not rehearsed"),
        (["--accelerator", "cuda", "--strategy.name", "fsdp"], "strategy.name=fsdp: not rehearsed"),
        (["--strategy.fsdp2.pipeline_parallel_size", "2"], "pipeline_parallel_size > 1: not rehearsed"),
    ],
)
def test_what_cannot_be_rehearsed_is_refused_before_any_rank_starts(
    overrides: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in fail_with(["rehearse", str(TOY_RECIPE), *LAYOUT, *overrides], capsys)
