"""`rehearse` on the library's GPU recipes at their own size: what each rank holds is what `plan` says, to the byte;
the step's peak is within 10% of plan's, and its collectives are the ones plan's communication model counts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import RECIPES, fail_with, run_cli

from {{ cookiecutter.package_name }}.commands.plan import plan_device
from {{ cookiecutter.package_name }}.commands.rehearse import planned
from {{ cookiecutter.package_name }}.recipe.library import recipes_on
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

PEAK_WITHIN = 0.10  # the rehearsed peak against plan's (docs/strategies.md: what neither counts)


def rehearsed(recipe: str, ranks: list[int], *overrides: str) -> dict:
    """The recipe's chosen ranks rehearsed, as JSON."""
    result = run_cli("rehearse", recipe, *overrides, "--ranks", ",".join(map(str, ranks)), "--json")
    assert result.returncode == 0, result.stderr
    rehearsal = json.loads(result.stdout)
    assert [rank["rank"] for rank in rehearsal["ranks"]] == ranks
    return rehearsal


def assert_as_planned(rehearsal: dict) -> None:
    """Model states to the byte, the peak within PEAK_WITHIN, the collectives plan counts (where it counts them)."""
    plan = rehearsal["plan"]
    for rank in rehearsal["ranks"]:
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == plan[held], (rank["rank"], held)
        assert rank["peak_bytes"] == pytest.approx(plan["peak_bytes"], rel=PEAK_WITHIN), rank["rank"]
        counted = plan["collectives"] or {}
        assert {name: rank["collectives"].get(name, 0) for name in counted} == counted, rank["rank"]


LONG_CONTEXT = ("llama-8b-cp-128k-multinode", "--model.block_size", "65536", "--model.n_layer", "8")  # seconds a rank


@pytest.mark.slow
def test_a_long_sequence_under_context_parallel_holds_its_mask_once_as_planned() -> None:
    """The 128K recipe's layout (cp=4 of 16 ranks, bf16-mixed, checkpointed) at 64K tokens and 8 layers, where the
    mask from a rank's 16K queries to the 64K keys is the largest activation: boolean, made once for every layer and
    converted only inside the attention, not copied at each block (a float32 mask passed to the blocks was cast to
    bf16 by fully_shard at every block and each copy kept: 1.42 of plan's peak). The recipe masks documents: a rank
    makes only its queries' rows of the mask (the whole sequence's, 64K x 64K, was formed and sliced), and gathers the
    example ids once a micro-batch, which plan counts."""
    assert_as_planned(rehearsed(LONG_CONTEXT[0], [0, 15], *LONG_CONTEXT[1:]))


@pytest.mark.slow
def test_context_parallel_under_a_pipeline_rehearses_within_each_pipeline_ranks_plan() -> None:
    """The same at pp=2 x cp=4: each stage's ranks hold their blocks' states as plan sizes that rank, to the byte; the
    first rank peaks within 10% of its figure and the last below its (plan bounds the last stage's logits by a whole
    piece's, as for any 1F1B pipeline: docs/strategies.md); the stages exchange a rank's 1/4 of each piece. Without
    the recipe's document mask: a pipeline passes no example ids between its stages yet. Every collective is one plan
    counts for the rank."""
    layout = ["--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_microbatches", "2",
              "--train.micro_batch_size", "2", "--train.grad_accum_steps", "8",
              "--data.document_mask", "false"]  # fmt: skip
    first, last = rehearsed(LONG_CONTEXT[0], [0, 15], *LONG_CONTEXT[1:], *layout)["ranks"]
    assert (first["mesh"]["pipeline"], last["mesh"]["pipeline"], last["mesh"]["context_parallel"]) == (0, 1, 3)
    for rank in (first, last):
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == rank["plan"][held], (rank["rank"], held)
    assert first["peak_bytes"] == pytest.approx(first["plan"]["peak_bytes"], rel=PEAK_WITHIN)
    assert last["peak_bytes"] <= last["plan"]["peak_bytes"]
    piece = 1 * 65536 // 4 * 4096 * 2  # one sample's quarter of the sequence, its hidden states in bf16
    assert first["collective_bytes"]["send"] == first["collectives"]["send"] * piece
    assert first["collectives"]["send"] == 8 * 2  # every piece of every micro-batch, forward
    for rank in (first, last):  # the keys' and values' gathers per piece over the rank's blocks among them
        assert rank["collectives"] == rank["plan"]["collectives"], rank["rank"]


@pytest.mark.slow
def test_experts_under_a_pipeline_rehearse_within_each_pipeline_ranks_plan() -> None:
    """The 30B-A3B recipe (ep=8 in each node) in 2 pipeline stages: each rank holds its stage's blocks and its group's
    experts as plan sizes them, to the byte; the first rank peaks within 10% of its figure (plan gathered every
    expert of the stage's blocks: 3.5x), the last below its (the 1F1B logits bound); their collectives are plan's."""
    layout = ["--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_microbatches", "2"]
    first, last = rehearsed("moe-30b-a3b-fsdp2-ep-multinode", [0, 31], *layout)["ranks"]
    assert (first["mesh"]["pipeline"], last["mesh"]["pipeline"]) == (0, 1)
    for rank in (first, last):
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == rank["plan"][held], (rank["rank"], held)
    assert first["peak_bytes"] == pytest.approx(first["plan"]["peak_bytes"], rel=PEAK_WITHIN)
    assert last["peak_bytes"] <= last["plan"]["peak_bytes"]
    assert first["collectives"]["all_to_all_single"] > 0  # the experts' exchanges, in the pipeline's stage
    for rank in (first, last):  # per piece over the rank's blocks, as plan counts them
        assert rank["collectives"] == rank["plan"]["collectives"], rank["rank"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_pipelines_last_stage_keeps_its_output_for_its_backward_as_plan_counts(precision: str) -> None:
    """cpu-pp-debug with a 32K vocabulary, where the logits dominate the last stage: the schedule keeps the stage's
    output (one piece's logits) for the stage's backward beside the loss's log-softmax, where without a pipeline the
    logits are freed once the loss has it. In fp32 the last rank peaks at 302.3 MiB, plan says 310.2; without that
    output plan would say 246.2 (0.81 of the peak). In bf16-mixed the stage's bf16 output is kept and the loss runs
    in fp32 as without a pipeline: 263.9 MiB, plan 267.9 (given bf16 logits the loss ran in bf16: 0.62 of plan).
    The first rank peaks at its embedding's backward: the gathered embedding (whole beside its shard), its fp32
    gradient summed over the pieces and the piece's own, and no gradient shard yet (one micro-batch a step: the
    schedule reduce-scatters after its last backward): 55.4 MiB, plan 58.7, in fp32; 44.8 MiB, plan 46.4, in bf16
    (plan said 51.0 and 50.8 before it counted them so: 1.09 and 0.88)."""
    layout = ["--model.vocab_size", "32768", "--model.n_embd", "64", "--model.n_head", "2", "--model.n_layer", "4",
              "--model.block_size", "512", "--train.micro_batch_size", "4", "--precision", precision]  # fmt: skip
    for rank in rehearsed("cpu-pp-debug", [0, 1], *layout)["ranks"]:
        assert rank["peak_bytes"] == pytest.approx(rank["plan"]["peak_bytes"], rel=PEAK_WITHIN), rank["rank"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "per_rank"),
    [
        ("ZBVZeroBubble", "2"),
        pytest.param("InterleavedZeroBubble", "1", marks=pytest.mark.matrix),
        pytest.param("InterleavedZeroBubble", "2", marks=pytest.mark.matrix),
    ],
)
def test_under_a_zero_bubble_schedule_plans_bound_holds_every_ranks_peak(schedule: str, per_rank: str) -> None:
    """The documented difference (planner/pipeline.py, docs/strategies.md): a zero-bubble schedule keeps each piece's
    graph for its weight half, which plan bounds by every piece of the micro-batch held uncheckpointed. On
    cpu-pp-debug (4 blocks, 4 pieces) the ranks peak at 0.73-0.88 of that bound: above it would be a run out of
    memory that plan said fits. Their collectives are plan's count: blocks kept gathered from the first forward to
    the schedule's last backward."""
    layout = ["--strategy.fsdp2.pipeline_schedule", schedule, "--strategy.fsdp2.pipeline_stages_per_rank", per_rank,
              "--model.n_layer", "4"]  # fmt: skip
    for rank in rehearsed("cpu-pp-debug", [0, 1], *layout)["ranks"]:
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == rank["plan"][held], (rank["rank"], held)
        assert 0.5 * rank["plan"]["peak_bytes"] < rank["peak_bytes"] <= rank["plan"]["peak_bytes"], rank["rank"]
        assert rank["collectives"] == rank["plan"]["collectives"], rank["rank"]


PIPELINES = ("llama-70b-pp-fsdp2-tp-multinode",)  # plan's figure is its worst rank's: the test below
RANKS = {"fsdp2-node": "0,7"}  # rank 0 of each, and the last of one: every rank of a node holds as much


def assert_rehearsed_as_planned_or_refused(recipe: str, result: subprocess.CompletedProcess) -> None:
    """A recipe's rehearsal holds what plan says (its world size, its step decision's all_reduce), or the recipe is
    one `rehearse` refuses in one line naming what to use instead."""
    if result.returncode == 2 and importlib.util.find_spec("torchao") is None and "float8" in recipe:
        # float8's torchao is an extra that builds on CPU where installed (`pip install -e '.[float8]'`)
        assert "strategy.fsdp2.float8=true needs torchao: pip install -e '.[float8]'" in result.stderr, recipe
        return
    if result.returncode == 2:  # DeepSpeed and FSDP1 build on CUDA only: the refusal names what to use instead
        assert recipe.startswith(("deepspeed", "fsdp1")), result.stderr
        assert "not rehearsed" in result.stderr and ("plan" in result.stderr or "fsdp2" in result.stderr), recipe
        return
    assert result.returncode == 0, (recipe, result.stderr[-3000:])
    rehearsal = json.loads(result.stdout)
    config = parse_recipe(["--config", str(RECIPES / f"{recipe}.yaml")])
    assert rehearsal["world_size"] == config.num_nodes * config.devices, recipe
    assert [rank["rank"] for rank in rehearsal["ranks"]] == [int(rank) for rank in RANKS.get(recipe, "0").split(",")]
    alone = rehearsal["world_size"] == 1  # the step decision's all_reduce, which one process skips
    assert all(alone or rank["collectives"].get("allreduce", 0) >= 1 for rank in rehearsal["ranks"]), recipe
    assert_as_planned(rehearsal)


@pytest.mark.slow
def test_every_gpu_recipe_of_the_library_rehearses_as_planned_or_says_why_not() -> None:
    """Every GPU recipe of the library at its own size (the pipeline's ranks: the test below), two recipes at a time
    (a rehearsed rank is a process of one core): ~20 s a recipe at most, 2 minutes for all of them here."""
    recipes = [name for name in recipes_on("cuda") if name not in PIPELINES]
    assert {"fsdp2-node", "ddp-node", "lora-llama-8b-node", "moe-30b-a3b-fsdp2-ep-multinode"} <= set(recipes)

    def rehearse(recipe: str) -> subprocess.CompletedProcess:
        return run_cli("rehearse", recipe, "--ranks", RANKS.get(recipe, "0"), "--json")

    with ThreadPoolExecutor(max_workers=2) as pool:
        for recipe, result in zip(recipes, pool.map(rehearse, recipes), strict=True):
            assert_rehearsed_as_planned_or_refused(recipe, result)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [64, 512])
def test_the_70b_pipelines_ranks_hold_their_blocks_shards_within_plans_largest_stage(nodes: int) -> None:
    """llama-70b-pp-fsdp2-tp-multinode on 64 nodes x 8 (512 ranks) and 512 x 8 (4096): 4 pipeline ranks of 2
    interleaved stages each, every stage's blocks split over 8 GPUs and sharded over its 16 (128) copies. The first
    rank (the embedding), the first of the second pipeline rank and the last (the final norm and head) hold their
    blocks' shards to the byte; plan sizes each rank and shows the one that holds the most (here the last), which
    bounds them all. Each rank's collectives are the ones plan counts for it: its blocks gathered and reduce-scattered,
    tensor parallel's all-reduces per block and piece (recomputed ones too), a send and a receive per piece and stage
    boundary, the loss's and the clip's all-reduces."""
    tensor_parallel, pipeline_parallel = 8, 4
    world_size = nodes * 8
    data_parallel = world_size // (tensor_parallel * pipeline_parallel)
    ranks = [0, world_size // pipeline_parallel, world_size - 1]
    rehearsal = rehearsed("llama-70b-pp-fsdp2-tp-multinode", ranks, "--num_nodes", str(nodes))
    assert rehearsal["world_size"] == world_size
    width, kv_width, hidden, vocab, layers = 8192, 1024, 28672, 128256, 80
    block = (
        2 * width * width + 2 * width * kv_width + 3 * width * hidden
    ) // tensor_parallel + 2 * width  # norms whole
    plan = rehearsal["plan"]
    for rank in rehearsal["ranks"]:
        held = rank["blocks"]
        ends = (vocab * width if 0 in held else 0) + (vocab * width + width if layers - 1 in held else 0)
        parameters = 4 * (len(held) * block + ends) // data_parallel  # fp32 shards under bf16-mixed
        assert (rank["parameters_bytes"], rank["gradients_bytes"]) == (parameters, parameters), rank["rank"]
        assert rank["optimizer_bytes"] == 2 * parameters  # AdamW's two moments
        for held_bytes in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held_bytes] <= plan[held_bytes]
        assert rank["collectives"] == rank["plan"]["collectives"], rank["rank"]  # each rank's, as plan counts them
    first, middle, last = (rank["blocks"] for rank in rehearsal["ranks"])
    assert 0 in first and layers - 1 in last
    assert len(first) == len(last) < len(middle)  # balanced by parameters: the embedding and the head weigh blocks


def test_beside_each_pipeline_rank_rehearse_sets_plans_figure_for_that_rank() -> None:
    """Llama-70B in 2 stages of 40 blocks under 1F1B (what `plan --write` writes for it): plan's figure is the last
    rank's (the loss's logits), the first rank's is its own, smaller; rehearsed, rank 0 peaked at 58.7 GiB and the last
    at 62.1 GiB (docs/strategies.md)."""
    layout = ["--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_schedule", "1F1B"]
    recipe = parse_recipe(["--config", str(RECIPES / "llama-70b-pp-fsdp2-tp-multinode.yaml"), *layout,
                           "--strategy.fsdp2.pipeline_stages_per_rank", "1"])  # fmt: skip
    device = plan_device(Namespace(gpu="H100", gpu_memory_gib=None), recipe)
    worst, first, last = planned(recipe, device), planned(recipe, device, 0), planned(recipe, device, 1)
    assert worst is not None and first is not None and worst == last
    assert first["peak_bytes"] / 2**30 == pytest.approx(62.35, abs=0.05)
    assert worst["peak_bytes"] / 2**30 == pytest.approx(70.54, abs=0.05)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["--model.n_kv_head", "4"], "tensor_parallel_size=8 does not divide model.n_kv_head=4"),
        (
            ["--model.n_head", "12", "--model.n_kv_head", "4", "--model.n_embd", "1536"],
            "does not divide model.n_head=12",
        ),
    ],
)
def test_a_tensor_parallel_size_the_heads_do_not_divide_is_refused_before_any_rank_starts(
    overrides: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in fail_with(["rehearse", "llama-70b-pp-fsdp2-tp-multinode", *overrides], capsys)


@pytest.mark.slow
def test_a_mixture_of_experts_under_expert_parallel_rehearses_with_balanced_routing() -> None:
    # Routing is in the values, which fake tensors do not carry: a rehearsal routes every rank's pairs evenly over the
    # experts (what load balancing aims at), so each all-to-all moves all of a rank's tokens x top_k rows.
    from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

    recipe = parse_recipe(["--config", str(RECIPES / "cpu-moe-debug.yaml")])
    rehearsal = rehearsed("cpu-moe-debug", [1])
    (rank,) = rehearsal["ranks"]
    assert_as_planned(rehearsal)  # the states to the byte, the peak (dispatch buffers counted), the collectives
    assert {"alltoall", "all_to_all_single"} <= set(rehearsal["plan"]["collectives"])
    model, micro_batches = recipe.model, recipe.train.grad_accum_steps
    rows = recipe.train.micro_batch_size * model.block_size * model.moe.top_k
    # Per layer and micro-batch: the counts exchanged once; the rows out and back in forward, again in backward.
    assert rank["collectives"]["alltoall"] == model.n_layer * micro_batches
    assert rank["collectives"]["all_to_all_single"] == 4 * model.n_layer * micro_batches
    assert rank["collective_bytes"]["all_to_all_single"] == 4 * model.n_layer * micro_batches * rows * model.n_embd * 4


TENSOR_PARALLEL = ("--strategy.fsdp2.tensor_parallel_size", "2")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "degree"),
    [(4, 2), pytest.param(2, 1, marks=pytest.mark.matrix)],
)  # dp=2 x tp=2, the experts split over each tensor-parallel pair; tp=2 alone, each expert sharded over the pair
def test_experts_under_tensor_parallel_rehearse_as_planned(devices: int, degree: int) -> None:
    """The tensor-parallel ranks share out the routed rows (token_split.py) and count as data-parallel ones for the
    experts: each rank's states hold 1/(data x tensor) of them, to the byte as plan says; each routes half its
    micro-batch's rows; the all-reduces are the ones plan counts for a mixture of experts under tensor parallel."""
    layout = [*TENSOR_PARALLEL, "--devices", str(devices), "--strategy.fsdp2.expert_parallel_size", str(degree)]
    recipe = parse_recipe(["--config", str(RECIPES / "cpu-moe-debug.yaml"), *layout])
    rehearsal = rehearsed("cpu-moe-debug", [0, devices - 1], *layout)
    assert_as_planned(rehearsal)
    model, micro_batches = recipe.model, recipe.train.grad_accum_steps
    for rank in rehearsal["ranks"]:
        assert rank["mesh"]["tensor_parallel"] == rank["rank"] % 2
        if degree > 1:
            rows = recipe.train.micro_batch_size * model.block_size * model.moe.top_k // 2
            exchanged = 4 * model.n_layer * micro_batches * rows * model.n_embd * 4
            assert rank["collective_bytes"]["all_to_all_single"] == exchanged
        else:  # no all-to-all: the experts sharded over the pair, gathered for forward and backward of each layer
            assert "all_to_all_single" not in rank["collectives"]
            assert rank["collectives"]["allgather"] == 2 * model.n_layer * micro_batches


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices", [2, pytest.param(4, marks=pytest.mark.matrix)]
)  # a node's ranks hold the experts whole (2) or shard them too (4)
def test_under_hsdp_each_layers_experts_are_all_reduced_across_the_nodes_as_plan_counts(devices: int) -> None:
    hsdp = ["--strategy.name", "hsdp", "--num_nodes", "2", "--devices", str(devices)]
    recipe = parse_recipe(["--config", str(RECIPES / "cpu-moe-debug.yaml"), *hsdp])
    rehearsal = rehearsed("cpu-moe-debug", [0], *hsdp)
    assert rehearsal["world_size"] == 2 * devices
    assert_as_planned(rehearsal)
    # Each block's and each layer's experts' shards, and the root's, across the 2 replicas; the step decision's; the
    # clip's norm over the node's shards, over the expert-parallel pair, and over the pairs holding the same experts
    # where there are two (4 devices).
    norm = 2 + (devices // 2 > 1)
    assert rehearsal["ranks"][0]["collectives"]["allreduce"] == 2 * recipe.model.n_layer + 2 + norm
