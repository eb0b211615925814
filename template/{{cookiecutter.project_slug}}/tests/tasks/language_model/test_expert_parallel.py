"""Expert parallelism (strategy.fsdp2.expert_parallel_size): the order the all-to-all's rows are computed in, the
degrees refused, the losses and weights of ep=1 at ep=2 (2 processes; under hsdp, 2 nodes of 2; through a
pipeline, 4), a checkpoint resumed across degrees."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, final_weights, losses_by_run, read_csv_metrics, run_cli, run_nodes

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.families.llama.moe import Experts, expert_order

RECIPE = RECIPES / "cpu-moe-debug.yaml"  # 4 experts, 2 processes
SHARDED = RECIPES / "cpu-moe-fsdp2-debug.yaml"  # the same on 4 processes: 2 expert-parallel pairs, sharded across
EP = "--strategy.fsdp2.expert_parallel_size"


def test_received_rows_are_ordered_by_local_expert_then_source_rank() -> None:
    # Two source ranks, two local experts: rank 0 sends 1 row to expert 0 and 2 to expert 1, rank 1 sends 2 and 1.
    # They arrive as [r0e0 | r0e1 r0e1 | r1e0 r1e0 | r1e1].
    order, counts = expert_order(torch.tensor([[1, 2], [2, 1]]), rows=6)
    assert order.tolist() == [0, 3, 4, 1, 2, 5]
    assert counts.tolist() == [3, 3]
    order, counts = expert_order(torch.tensor([[0, 3], [2, 0]]), rows=5)  # an expert or a rank with none
    assert order.tolist() == [3, 4, 0, 1, 2] and counts.tolist() == [2, 3]
    rows = torch.arange(5)
    assert torch.equal(rows[order][torch.argsort(order)], rows)  # the way back restores the arrival order


def test_experts_that_receive_no_rows_return_none_and_a_zero_gradient() -> None:
    experts = Experts(num_experts=2, width=16, hidden=32)  # torch._grouped_mm would refuse the empty input
    for weight in experts.parameters():
        torch.nn.init.normal_(weight)
    out = experts(torch.zeros(0, 16), torch.tensor([0, 0]))
    assert out.shape == (0, 16)
    out.sum().backward()
    assert all(weight.grad is not None and not weight.grad.any() for weight in experts.parameters())


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        (RECIPE, [EP, "3"], "strategy.fsdp2.expert_parallel_size=3 does not divide the 2 data-parallel ranks"),
        (
            RECIPE,
            [EP, "4", "--devices", "4", "--model.moe.num_experts", "6"],
            "strategy.fsdp2.expert_parallel_size=4 does not divide model.moe.num_experts=6 (each rank holds an equal"
            " share of the experts: choose 1 or 2)",
        ),
        (
            RECIPES / "cpu-llama-debug.yaml",
            [EP, "2"],
            "strategy.fsdp2.expert_parallel_size=2: task=language_model's model has no experts to split (set it to 1)",
        ),
        (RECIPE, [EP, "0"], "strategy.fsdp2.expert_parallel_size=0 must be >= 1"),
        (
            RECIPE,
            [EP, "4", "--strategy.fsdp2.context_parallel_size", "2"],
            "strategy.fsdp2.expert_parallel_size=4 does not divide the 2 data x context-parallel ranks (devices x"
            " num_nodes; choose 1 or 2)",
        ),
        (
            RECIPE,
            [EP, "2", "--strategy.fsdp2.pipeline_parallel_size", "2", "--model.n_layer", "2"],
            "strategy.fsdp2.expert_parallel_size=2 does not divide the 1 data-parallel ranks (devices x num_nodes / 2"
            " pipeline stages; choose 1)",
        ),
        (
            RECIPE,
            [EP, "4", "--strategy.name", "hsdp", "--num_nodes", "2"],
            "strategy.fsdp2.expert_parallel_size=4 does not divide the 2 ranks of a node (strategy.name=hsdp"
            " replicates the experts across nodes; choose 1 or 2)",
        ),
    ],
)
def test_degrees_the_model_or_the_mesh_cannot_hold_are_refused_in_one_line(
    recipe: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)):
        parse_recipe(["--config", str(recipe), *overrides])
    assert parse_recipe(["--config", str(RECIPE), EP, "2"]).strategy.fsdp2.expert_parallel_size == 2


def args(out_dir: Path, degree: int, steps: int, recipe: Path = RECIPE) -> list[str]:
    """cpu-moe-debug (or `recipe`) shrunk to seconds, at expert-parallel degree `degree`."""
    return [
        "train", "--config", str(recipe), "--out_dir", str(out_dir), "--logger.name", "csv", EP, str(degree),
        "--model.n_layer", "1", "--model.block_size", "16", "--train.max_steps", str(steps), "--eval.every_steps", "0",
        "--logger.log_every_steps", "1", "--checkpoint.save_every_steps", "3", "--model.moe.capacity_factor", "1.0",
    ]  # fmt: skip


def assert_same_weights_within(actual: Path, expected: Path, steps: int) -> None:
    """The final weights of two runs: the same names (every expert under its global one) and values within 1e-5."""
    weights, expected_weights = final_weights(actual, steps), final_weights(expected, steps)
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_two_expert_parallel_ranks_give_the_losses_and_weights_of_one(tmp_path: Path) -> None:
    runs = {degree: tmp_path / f"ep{degree}" for degree in (1, 2)}
    for degree, out_dir in runs.items():
        result = run_cli(*args(out_dir, degree, 3))
        assert result.returncode == 0, result.stderr[-3000:]
    (alone,), (split,) = losses_by_run(runs[1]), losses_by_run(runs[2])
    assert alone.keys() == split.keys() == {1, 2, 3}
    assert all(abs(alone[step] - split[step]) < 1e-5 for step in alone), (alone, split)
    weights, expected = final_weights(runs[2], 3), final_weights(runs[1], 3)
    assert weights.keys() == expected.keys()  # every expert under its global name, whole
    assert weights["blocks.0.mlp.experts.gate"].shape == expected["blocks.0.mlp.experts.gate"].shape == (4, 128, 128)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_under_hsdp_experts_split_inside_each_node_give_the_losses_and_weights_of_hsdp_alone(tmp_path: Path) -> None:
    """2 nodes of 2 processes: each node's 2 ranks split the experts (the all-to-alls stay inside it), and the nodes
    replicate them, as hsdp replicates every other parameter."""
    runs = {degree: tmp_path / f"ep{degree}" for degree in (1, 2)}
    for degree, out_dir in runs.items():
        run_nodes([*args(out_dir, degree, 3), "--strategy.name", "hsdp", "--num_nodes", "2"], nodes=2)
    (alone,), (split,) = losses_by_run(runs[1]), losses_by_run(runs[2])
    assert alone.keys() == split.keys() == {1, 2, 3}
    assert all(abs(alone[step] - split[step]) < 1e-5 for step in alone), (alone, split)
    weights, expected = final_weights(runs[2], 3), final_weights(runs[1], 3)
    assert weights.keys() == expected.keys()
    assert weights["blocks.0.mlp.experts.down"].shape == expected["blocks.0.mlp.experts.down"].shape == (4, 128, 128)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_experts_split_over_a_context_parallel_group_train_as_one_process_on_whole_sequences(tmp_path: Path) -> None:
    """cp=2 x ep=2 on 2 processes: each holds half of every sequence of the same samples and half of the experts,
    which the halves' tokens reach by all-to-all; against 1 process with all of both. Dropless and without the
    auxiliary loss, which (as with data parallel) each rank computes over its own tokens."""
    same = ["--model.moe.load_balance", "none", "--model.moe.capacity_factor", "null"]
    runs = {"split": tmp_path / "split", "whole": tmp_path / "whole"}
    layouts = {"split": ["--strategy.fsdp2.context_parallel_size", "2"], "whole": ["--devices", "1"]}
    for name, out_dir in runs.items():
        result = run_cli(*args(out_dir, 2 if name == "split" else 1, 3), *same, *layouts[name])
        assert result.returncode == 0, result.stderr[-3000:]
    (whole,), (split,) = losses_by_run(runs["whole"]), losses_by_run(runs["split"])
    assert whole.keys() == split.keys() == {1, 2, 3}
    assert all(abs(whole[step] - split[step]) < 1e-5 for step in whole), (whole, split)
    assert_same_weights_within(runs["split"], runs["whole"], 3)


@pytest.mark.slow
@pytest.mark.matrix
def test_experts_sharded_by_expert_and_by_fsdp2_on_four_processes_give_the_losses_of_fsdp2_alone(
    tmp_path: Path,
) -> None:
    runs = {degree: tmp_path / f"ep{degree}" for degree in (1, 2)}  # ep=2: each pair of experts on 2 ranks too
    for degree, out_dir in runs.items():
        result = run_cli(*args(out_dir, degree, 3, SHARDED))
        assert result.returncode == 0, result.stderr[-3000:]
    (alone,), (split,) = losses_by_run(runs[1]), losses_by_run(runs[2])
    assert alone.keys() == split.keys() == {1, 2, 3}
    assert all(abs(alone[step] - split[step]) < 1e-5 for step in alone), (alone, split)


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_under_another_expert_parallel_degree(before: int, after: int, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert run_cli(*args(reference, after, 5)).returncode == 0
    (expected,) = losses_by_run(reference)
    moved = tmp_path / "moved"
    assert run_cli(*args(moved, before, 5), fault="kill-at-step:4").returncode == -signal.SIGKILL
    resumed = run_cli(*args(moved, after, 5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, after_resume = losses_by_run(moved)
    assert after_resume.keys() == {4, 5}
    assert all(abs(after_resume[step] - expected[step]) < 1e-5 for step in after_resume), (after_resume, expected)


PIPELINE = ("--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_microbatches", "2")
MOE_FIGURES = ("moe/aux_loss", "moe/load_imbalance", "moe/router_entropy", "moe/dropped_fraction")


def figures(out_dir: Path, name: str) -> list[float]:
    """A run's logged values of one metric, in step order."""
    return [float(row[name]) for row in read_csv_metrics(out_dir) if row.get(name)]


ZBV = ["ZBVZeroBubble", "--strategy.fsdp2.pipeline_stages_per_rank", "2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "blocks", "tensor"),
    [
        pytest.param(["1F1B"], "2", False, id="1F1B"),
        # two stages a rank in a V: each rank's two stages add their layers' figures and auxiliary terms
        pytest.param(ZBV, "4", False, id="zbv", marks=pytest.mark.matrix),
        # each stage's tensor-parallel pair splits its layers' attention and shared experts, shares out the routed
        # rows and holds half the experts each; under ZB-V the tensor-parallel sums run in the input-gradient half
        pytest.param(["1F1B"], "2", True, id="1F1B-tp2", marks=pytest.mark.matrix),
        pytest.param(ZBV, "4", True, id="zbv-tp2", marks=pytest.mark.matrix),
    ],
)
def test_experts_split_inside_each_pipeline_stage_train_as_one_process_with_the_auxiliary_loss(
    schedule: list[str], blocks: str, tensor: bool, tmp_path: Path
) -> None:
    """pp=2 x ep=2 (x tp=2) on 4 processes (each stage's 2 data-parallel or tensor-parallel ranks split its layers'
    experts; micro-batches of 4 in 2 pieces) against 1 process with micro-batches of 2, the pieces: the same
    losses, MoE figures, validation loss and weights. Each stage's auxiliary loss reaches backward where the stage
    runs (the last stage's loss never sees it): at a weight of 0.1 the routers end 3e-3 away from a run without it,
    here within 1e-5. Under tensor parallel capacity stays at the recipe's (the router sees every token)."""
    shared = [
        "train", "--config", str(RECIPE), "--logger.name", "csv", "--model.n_layer", blocks, "--model.block_size",
        "16", "--train.max_steps", "3", "--eval.every_steps", "3", "--logger.log_every_steps", "1",
        "--checkpoint.save_every_steps", "0", "--model.moe.aux_loss_weight", "0.1",
        *([] if tensor else ["--model.moe.capacity_factor", "null"]),
    ]  # fmt: skip
    steps = [TENSOR, "2", "--train.grad_accum_steps", "2", "--eval.batches", "2"] if tensor else ["--eval.batches", "1"]
    layouts = {  # 8 samples a step and 8 validated, either way
        "pipeline": [*PIPELINE, "--strategy.fsdp2.pipeline_schedule", *schedule, EP, "2", "--devices", "4",
                     "--train.micro_batch_size", "4", *steps],
        "whole": [EP, "1", "--devices", "1", "--train.micro_batch_size", "2", "--train.grad_accum_steps", "4",
                  "--eval.batches", "4"],
    }  # fmt: skip
    runs = {name: tmp_path / name for name in layouts}
    for name, out_dir in runs.items():
        result = run_cli(*shared, "--out_dir", str(out_dir), *layouts[name])
        assert result.returncode == 0, result.stderr[-3000:]
    (whole,), (split,) = losses_by_run(runs["whole"]), losses_by_run(runs["pipeline"])
    assert whole.keys() == split.keys() == {1, 2, 3}
    assert all(abs(whole[step] - split[step]) < 1e-5 for step in whole), (whole, split)
    for name in (*MOE_FIGURES, "val/loss"):
        expected = figures(runs["whole"], name)
        assert len(expected) == (1 if name == "val/loss" else 3)
        assert figures(runs["pipeline"], name) == pytest.approx(expected, abs=1e-5), name
    assert_same_weights_within(runs["pipeline"], runs["whole"], 3)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_checkpoint_of_experts_split_in_a_pipeline_resumes_in_one_process(tmp_path: Path) -> None:
    """Saved by pp=2 x ep=2 on 4 processes at step 2, resumed on 1 process (the pieces as its micro-batches): steps 3
    and 4 are those of a run on 1 process throughout (1e-5): every expert under its global name, whatever held it."""
    shared = [
        "train", "--config", str(RECIPE), "--logger.name", "csv", "--model.n_layer", "2", "--model.block_size", "16",
        "--eval.every_steps", "0", "--logger.log_every_steps", "1", "--checkpoint.save_every_steps", "2",
        "--model.moe.capacity_factor", "null",
    ]  # fmt: skip
    one = [EP, "1", "--devices", "1", "--train.micro_batch_size", "2", "--train.grad_accum_steps", "4"]
    split = [*PIPELINE, EP, "2", "--devices", "4", "--train.micro_batch_size", "4"]
    reference, moved = tmp_path / "reference", tmp_path / "moved"
    assert run_cli(*shared, "--out_dir", str(reference), "--train.max_steps", "4", *one).returncode == 0
    assert run_cli(*shared, "--out_dir", str(moved), "--train.max_steps", "2", *split).returncode == 0
    resumed = run_cli(*shared, "--out_dir", str(moved), "--train.max_steps", "4", *one)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (expected,) = losses_by_run(reference)
    _, after_resume = losses_by_run(moved)
    assert after_resume.keys() == {3, 4}
    assert all(abs(after_resume[step] - expected[step]) < 1e-5 for step in after_resume), (after_resume, expected)


TENSOR = "--strategy.fsdp2.tensor_parallel_size"


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param([TENSOR, "2", EP, "2"], id="tp2-ep2"),  # the experts split over the tensor-parallel pair
        pytest.param([TENSOR, "2", EP, "1"], id="tp2-ep1", marks=pytest.mark.matrix),  # each expert sharded over it
        pytest.param([TENSOR, "2", EP, "2", "--devices", "4"], id="dp2-tp2-ep2", marks=pytest.mark.matrix),
    ],
)
def test_tensor_parallel_ranks_sharing_out_the_tokens_train_as_one_process(layout: list[str], tmp_path: Path) -> None:
    """Tensor parallel over 2 ranks, which split attention and the shared experts and share out the routed experts'
    tokens (each rank computes the routed experts of half of them), against 1 process (2 processes for dp2) with
    the same batches: the same losses, MoE figures (capacity and auxiliary loss included: the router sees every
    token on every rank) and weights."""
    shared = [
        "train", "--config", str(RECIPE), "--logger.name", "csv", "--model.n_layer", "2", "--model.block_size", "16",
        "--train.max_steps", "3", "--eval.every_steps", "0", "--logger.log_every_steps", "1",
        "--checkpoint.save_every_steps", "3", "--model.moe.aux_loss_weight", "0.1", "--model.moe.capacity_factor",
        "1.0",
    ]  # fmt: skip
    devices = layout[layout.index("--devices") + 1] if "--devices" in layout else "2"
    layouts = {"split": layout, "whole": [EP, "1", "--devices", str(int(devices) // 2)]}
    runs = {name: tmp_path / name for name in layouts}
    for name, out_dir in runs.items():
        result = run_cli(*shared, "--out_dir", str(out_dir), *layouts[name])
        assert result.returncode == 0, result.stderr[-3000:]
    (whole,), (split,) = losses_by_run(runs["whole"]), losses_by_run(runs["split"])
    assert whole.keys() == split.keys() == {1, 2, 3}
    assert all(abs(whole[step] - split[step]) < 1e-5 for step in whole), (whole, split)
    for name in MOE_FIGURES:
        expected = figures(runs["whole"], name)
        assert len(expected) == 3 and (name != "moe/dropped_fraction" or max(expected) > 0), name
        assert figures(runs["split"], name) == pytest.approx(expected, abs=1e-5), name
    assert_same_weights_within(runs["split"], runs["whole"], 3)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_checkpoint_of_experts_split_over_tensor_parallel_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    """Saved by tp=2 x ep=2 on 2 processes at step 2 (the experts split over the tensor-parallel pair, attention and
    the shared experts split by tensor parallel), resumed on 1 process: steps 3 and 4 are those of a run on 1 process
    throughout (1e-5)."""
    shared = [
        "train", "--config", str(RECIPE), "--logger.name", "csv", "--model.n_layer", "2", "--model.block_size", "16",
        "--eval.every_steps", "0", "--logger.log_every_steps", "1", "--checkpoint.save_every_steps", "2",
    ]  # fmt: skip
    one, split = [EP, "1", "--devices", "1"], [TENSOR, "2", EP, "2"]
    reference, moved = tmp_path / "reference", tmp_path / "moved"
    assert run_cli(*shared, "--out_dir", str(reference), "--train.max_steps", "4", *one).returncode == 0
    assert run_cli(*shared, "--out_dir", str(moved), "--train.max_steps", "2", *split).returncode == 0
    resumed = run_cli(*shared, "--out_dir", str(moved), "--train.max_steps", "4", *one)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (expected,) = losses_by_run(reference)
    _, after_resume = losses_by_run(moved)
    assert after_resume.keys() == {3, 4}
    assert all(abs(after_resume[step] - expected[step]) < 1e-5 for step in after_resume), (after_resume, expected)
