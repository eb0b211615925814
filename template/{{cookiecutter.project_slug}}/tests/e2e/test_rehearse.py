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
    one reduce-scatter per block and the root; one all-reduce of the clip's gradient norm over the shards (DTensor's,
    inside the norm's operators) and one for the step decision, without a barrier before it (Fabric's all_reduce
    waits at one: a second collective every step)."""
    depth = MlpConfig().depth
    assert rehearsal["plan"]["collectives"] == {"allgather": 2 * depth + 1, "reduce_scatter": depth + 1, "allreduce": 2}
    for rank in rehearsal["ranks"]:
        counts = rank["collectives"]
        assert counts == rehearsal["plan"]["collectives"]  # every one the step issues, and no barrier
        assert rank["peak_bytes"] > rank["parameters_bytes"] + rank["gradients_bytes"] + rank["optimizer_bytes"]


PIPELINE = ["--strategy.fsdp2.pipeline_parallel_size", "2"]
ZBV = ["--strategy.fsdp2.pipeline_schedule", "ZBVZeroBubble", "--strategy.fsdp2.pipeline_stages_per_rank", "2"]
# The toy recipe's micro-batch of 4 vectors fed through in 4 pieces of one vector, 2 micro-batches a step.
MICRO_BATCH, PIECES, ACCUMULATE = 4, 4, 2


def stage_shapes(config: MlpConfig, stage: int, stages: int) -> list[tuple[int, ...]]:
    """The parameter shapes pipeline stage `stage` of `stages` holds: an even share of the blocks (as the balanced split
    gives the toy's equal blocks when they divide), and the input layer on the first stage, the head on the last."""
    every = shapes(config)
    per_block, per_stage = len(every[2:-2]) // config.depth, config.depth // stages
    blocks = every[2 + per_block * per_stage * stage : 2 + per_block * per_stage * (stage + 1)]
    return (every[:2] if stage == 0 else []) + blocks + (every[-2:] if stage == stages - 1 else [])


def stages_of(pipeline_rank: int, size: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds: in a V, its rank and its mirror; else every size-th from its rank."""
    if schedule == "ZBVZeroBubble":
        return [pipeline_rank, 2 * size - 1 - pipeline_rank]
    return [pipeline_rank + size * round_ for round_ in range(per_rank)]


def sends_per_piece(held: list[int], stages: int) -> int:
    """What a rank sends for each piece: each stage's output to the next stage and its input gradient to the one
    before, where that stage is on another rank (it receives as many: the activations in, the gradients back)."""
    return sum((stage + 1 < stages and stage + 1 not in held) + (stage > 0 and stage - 1 not in held) for stage in held)


@pytest.mark.slow
def test_a_pipeline_stages_ranks_hold_its_blocks_shards_and_send_each_piece_once_per_boundary(toy_source: Path) -> None:
    """1F1B over 2 stages of 2 blocks on 64 ranks (32 data-parallel ranks a stage), each micro-batch in 4 pieces, 2
    micro-batches a step: the first rank of each stage and the last hold fully_shard's shards of their stage's
    parameters, to the byte, and send one activation forward (stage 0) or one gradient back (stage 1) per piece; every
    collective of the step is one plan counts for that rank."""
    layout = [*LAYOUT, "--model.depth", "4", *PIPELINE, "--strategy.fsdp2.pipeline_microbatches", str(PIECES)]
    result = run_cli(
        "rehearse", str(TOY_RECIPE), *layout, "--train.grad_accum_steps", str(ACCUMULATE), "--json", source=toy_source
    )
    assert result.returncode == 0, result.stderr
    rehearsal = json.loads(result.stdout)
    assert [rank["rank"] for rank in rehearsal["ranks"]] == [0, 32, 63]  # the first of each stage, the last
    config = MlpConfig(width=WIDTH, depth=4)
    piece_bytes = MICRO_BATCH // PIECES * WIDTH * 4  # a piece of the residual stream, fp32
    for rank in rehearsal["ranks"]:
        stage, shard = divmod(rank["rank"], 32)
        assert rank["mesh"] == {"pipeline": stage, "data_parallel": shard, "tensor_parallel": 0}
        held = stage_shapes(config, stage, 2)
        expected = 4 * sum(fully_shard_elements(shape, shard, 32) for shape in held)
        assert rank["parameters_bytes"] == expected
        assert rank["gradients_bytes"] == expected
        assert rank["optimizer_bytes"] == 2 * expected
        for direction in ("send", "recv"):
            assert rank["collectives"][direction] == PIECES * ACCUMULATE
            assert rank["collective_bytes"][direction] == PIECES * ACCUMULATE * piece_bytes
        assert rank["collectives"] == rank["plan"]["collectives"], rank["rank"]  # the loss's, the norm's too


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize(
    ("schedule", "per_rank"),
    [
        ("GPipe", 1),
        ("1F1B", 1),
        ("Interleaved1F1B", 2),
        ("InterleavedZeroBubble", 1),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
    ],
)
def test_every_schedule_rehearses_its_stages_and_sends_what_it_implies(
    toy_source: Path, schedule: str, per_rank: int
) -> None:
    """2 ranks of one stage each, or two (looped, or in a V): each rank holds its stages' blocks whole (no data
    parallel) and sends per piece one activation or gradient for each boundary between its stages and another rank's:
    the collectives plan counts for it (planner/collectives.py)."""
    stages, depth = 2 * per_rank, 4
    layout = [
        *PIPELINE, "--strategy.fsdp2.pipeline_schedule", schedule, "--strategy.fsdp2.pipeline_stages_per_rank",
        str(per_rank), "--strategy.fsdp2.pipeline_microbatches", str(PIECES), "--model.depth", str(depth),
    ]  # fmt: skip
    result = run_cli("rehearse", str(TOY_RECIPE), *layout, "--json", source=toy_source)
    assert result.returncode == 0, result.stderr
    config = MlpConfig(depth=depth)
    for rank in json.loads(result.stdout)["ranks"]:
        held = stages_of(rank["rank"], 2, per_rank, schedule)
        elements = sum(math.prod(shape) for stage in held for shape in stage_shapes(config, stage, stages))
        assert rank["parameters_bytes"] == 4 * elements
        for direction in ("send", "recv"):
            assert rank["collectives"][direction] == PIECES * sends_per_piece(held, stages), (schedule, rank["rank"])
        assert rank["collectives"] == rank["plan"]["collectives"], (schedule, rank["rank"])


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
        # each block's and the root's shard across the replicas; the clip's norm over a replica's shards; the step
        # decision
        "allreduce": depth + 1 + 1 + 1,
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
        (["--model.width", "36", "--strategy.fsdp2.tensor_parallel_size", "8"], "8 does not divide model.width=36"),
        # Pipeline layouts that train refuses too: a stage without a block, stages that do not divide the ranks.
        (
            ["--strategy.fsdp2.pipeline_parallel_size", "4"],
            "4 pipeline stages need at least 4 blocks (the model has 3)",
        ),
        ([*PIPELINE, *ZBV], "4 pipeline stages need at least 4 blocks (the model has 3)"),
        ([*PIPELINE, "--strategy.fsdp2.pipeline_split", "[3, 0]"], "pipeline_split=[3, 0] must give each of the 2"),
        (["--strategy.fsdp2.pipeline_parallel_size", "3"], "pipeline_parallel_size=3 x tensor_parallel_size=1"),
        # A pipeline whose pieces would take minutes to run through the blocks of a rank.
        (
            [*PIPELINE, "--train.micro_batch_size", "4096", "--strategy.fsdp2.pipeline_microbatches", "4096"],
            "pipeline_microbatches=4096: not rehearsed: 4096 pieces through 2 blocks a rank are 8192 block passes",
        ),
    ],
)
def test_what_cannot_be_rehearsed_is_refused_before_any_rank_starts(
    overrides: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in fail_with(["rehearse", str(TOY_RECIPE), *LAYOUT, *overrides], capsys)


@pytest.mark.usefixtures("toy_task_here")
def test_a_checkpoint_to_resume_that_the_layout_cannot_read_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recipe that resumes a checkpoint saved in DeepSpeed's own layout under fsdp2 (which reads only
    torch.distributed.checkpoint's and ddp's): train would fail once launched, the rehearsal says so first."""
    folder = tmp_path / "run" / "checkpoints" / "step-00000004"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "mp_rank_00_model_states.pt").write_bytes(b"0" * 100)
    files = {"state/mp_rank_00_model_states.pt": 100}
    (folder / "meta.json").write_text(json.dumps({"step": 4, "strategy": "deepspeed", "files": files}))
    resume = ["--out_dir", str(tmp_path / "run"), "--checkpoint.resume", "auto"]
    says = fail_with(["rehearse", str(TOY_RECIPE), *LAYOUT, *resume], capsys)
    assert "was saved by strategy.name=deepspeed, whose layout strategy.name=fsdp2 cannot read" in says
    assert "resume it with strategy.name=deepspeed" in says
