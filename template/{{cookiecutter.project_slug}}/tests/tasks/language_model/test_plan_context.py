"""`plan` of context parallelism (planner/context.py): activations of a part of the sequence, the keys and values it
all-gathers, the degrees it offers a long sequence, the longest context that fits and the recipe it writes; in-process
(the rehearsal that measures the same on 2 ranks: the last test)."""

from __future__ import annotations

import dataclasses
import json
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from helpers import RECIPES, plan_json, run_cli

from {{ cookiecutter.package_name }}.commands.plan import plan_device
from {{ cookiecutter.package_name }}.commands.recipes import validate_recipes
from {{ cookiecutter.package_name }}.planner import context
from {{ cookiecutter.package_name }}.planner.hardware import INTERCONNECTS
from {{ cookiecutter.package_name }}.planner.measured import MeasuredCost
from {{ cookiecutter.package_name }}.planner.options import PlanOption
from {{ cookiecutter.package_name }}.planner.plan import plan, plan_inputs
from {{ cookiecutter.package_name }}.planner.report import written_recipe
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.tasks import task_for
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import Shape, layer_activations

CP = str(RECIPES / "cpu-cp-debug.yaml")  # a Llama of 4 layers, width 128, 4 heads over 2 key/value heads, 128 tokens
LLAMA_8B = str(RECIPES / "llama-8b-fsdp2-node.yaml")
LONG = ["--model.block_size", "131072", "--num_nodes", "2"]  # 128K tokens on 2 nodes of 8 H100s


def shape_of(*args: str) -> Shape:
    """The language model's sizing shape of a recipe and overrides."""
    cost = task_for(parse_recipe(["--config", *args])).model_cost()
    assert isinstance(cost, Shape)
    return cost


def sharded(degree: int, tensor_parallel: int = 1) -> PlanOption:
    return PlanOption("fsdp2", stage=3, why="", tensor_parallel=tensor_parallel, context_parallel=degree)


def test_at_cp2_a_rank_holds_half_of_each_layers_activations_and_the_mask_once() -> None:
    """In fp32 every term of a layer and of the head grows with the positions: half at cp=2. The attention holds the
    boolean s/2 x s mask once, for every layer; what it makes of the whole sequence (the other half of the keys and
    values, b x s/2 x 2 x kv_width, the width 2 heads of 32, and SDPA's float s/2 x s mask, 4 bytes each) exists for
    one layer at a time: in forward, and again when backward recomputes it."""
    shape, b, s = shape_of(CP), 8, 128
    half = dataclasses.replace(shape, sequence_length=s // 2)
    assert layer_activations(half, b, "32-true") == layer_activations(shape, b, "32-true") / 2
    gathered = context.gathered_layer_bytes(shape, b, "32-true", 1, 2)
    assert gathered == 4 * b * (s // 2) * 2 * (2 * 32) + 4 * (s // 2) * s
    whole = context.activations(shape, sharded(1), b, "32-true", 1, False)
    split = context.activations(shape, sharded(2), b, "32-true", 1, False)
    assert whole == shape.activations(b, "32-true")
    assert split.held - (s // 2) * s == whole.held / 2
    assert split.recompute_peak - gathered == whole.recompute_peak / 2
    assert split.backward_transient == max(whole.backward_transient / 2, gathered)
    assert split.held_checkpointed - (s // 2) * s == whole.held_checkpointed / 2  # the boolean mask, kept once


def test_the_gathers_counted_per_layer_are_what_the_attention_sends() -> None:
    """Keys and values of b x s x kv_width each are gathered per layer, a rank sending its (c-1)/c share, and their
    gradients reduce-scattered back, the keys and values gathered again when backward recomputes the attention: 6
    collectives per layer; `rehearse` counts them as allgather and reduce_scatter."""
    shape, b, s, kv_width = shape_of(CP), 8, 128, 2 * 32
    for degree in (2, 4):
        sent = context.gathered_elements(shape, sharded(degree), b)
        assert sent == 6 * shape.n_layer * b * s * kv_width * (degree - 1) / degree
    assert context.gathered_elements(shape, sharded(4, tensor_parallel=2), b) == 6 * 4 * b * s * 32 * 3 / 4
    assert context.gathered_elements(shape, sharded(1), b) == 0
    assert context.context_collectives(shape, sharded(2), 3) == {"allgather": 48, "reduce_scatter": 24}
    assert context.context_collectives(shape, sharded(1), 3) == {}


def test_the_gathers_take_the_nodes_links_when_the_group_fits_in_a_node_and_the_networks_share_otherwise() -> None:
    """Per optimizer step: the recipe's 16 accumulated micro-batches, each run by the c ranks of a group, the elements
    sent in bf16; a group of 4 in a node of 8 over its links, one of 16 over 2 nodes at a rank's share of InfiniBand."""
    recipe = parse_recipe(["--config", LLAMA_8B, *LONG])
    shape = task_for(recipe).model_cost()
    assert isinstance(shape, Shape)
    device = plan_device(Namespace(gpu="H100", gpu_memory_gib=None), recipe)
    inputs = plan_inputs(recipe, shape, shape.parameters(), device, INTERCONNECTS["infiniband"], 0.1)
    intra, across = device.intra_node_gb_s * 1e9, INTERCONNECTS["infiniband"] * 1e9 / 8
    for degree, link in ((4, intra), (16, across)):
        sent = context.gathered_elements(shape, sharded(degree), 1)
        seconds = context.gather_seconds(inputs, sharded(degree), 1)
        assert seconds == pytest.approx(sent * 16 * degree * 2 / link), degree
    assert context.gather_seconds(inputs, sharded(1), 1) == 0


def test_a_degree_divides_the_data_parallel_ranks_and_leaves_the_sequence_two_equal_chunks_per_rank() -> None:
    assert context.degrees(131072, 16) == [2, 4, 8, 16]
    assert context.degrees(20, 16) == [2]  # 20 tokens make 4 equal chunks, not 8
    assert context.degrees(131072, 6) == [2]  # 3 and 6 leave unequal chunks
    shape = shape_of(CP)
    assert context.sequence_length(shape) == 128
    measured = MeasuredCost(None, 1, 0.0, 0.0)  # type: ignore[arg-type]  # a task without a sequence: an image's
    assert context.sequence_length(measured) is None


def test_a_long_sequence_is_offered_each_degree_of_the_options_that_split_it_and_a_short_one_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def offered(*args: str) -> list[str]:
        return [option["strategy"] for option in plan_json(capsys, *args)["options"] if "_cp" in option["strategy"]]

    assert offered(LLAMA_8B, *LONG) == [
        *("fsdp2_cp2", "fsdp2_cp4", "fsdp2_cp8", "fsdp2_cp16"),
        *("fsdp2_tp2_cp2", "fsdp2_tp2_cp4", "fsdp2_tp2_cp8", "fsdp2_tp4_cp2", "fsdp2_tp4_cp4", "fsdp2_tp8_cp2"),
    ]  # no pipeline, no hsdp replicas (strategies/context_parallel.py refuses both)
    assert offered(LLAMA_8B) == []  # 8192 tokens fit without
    assert offered(CP) == []


def test_plan_recommends_a_degree_when_the_sequence_fits_no_other_way_and_says_how_long_one_can_be(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """128K tokens of an 8B Llama: no option holds them on an H100 without splitting the sequence, even with
    checkpointing; the smallest degree that fits is taken. The longest context that fits on 16 H100s is longer."""
    result = plan_json(capsys, LLAMA_8B, *LONG)
    fits = {o["strategy"] for o in result["options"] if o["fits"]}
    assert fits and all("_cp" in name for name in fits)
    assert result["recommended"]["strategy"] == "fsdp2_cp4"
    assert result["recommended"]["context_parallel_size"] == 4
    assert "1/4 of every sequence" in result["reason"]
    assert result["longest_context"]["sequence_length"] > 131072
    assert plan_json(capsys, LLAMA_8B)["longest_context"]["sequence_length"] >= 8192


def test_the_written_recipe_sets_the_context_parallel_size_and_recipes_validate_accepts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = yaml.safe_load((RECIPES / "llama-8b-fsdp2-node.yaml").read_text())
    recipe = parse_recipe(["--config", LLAMA_8B, *LONG])
    cost = task_for(recipe).model_cost()
    assert cost is not None
    device = plan_device(Namespace(gpu="H100", gpu_memory_gib=None), recipe)
    result = plan(plan_inputs(recipe, cost, cost.parameters(), device, INTERCONNECTS["infiniband"], 0.1))
    written = written_recipe(base, {"block_size": 131072}, result)
    assert written["strategy"]["fsdp2"]["context_parallel_size"] == 4
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(written, sort_keys=False))
    validate_recipes([str(path)], [], "{{ cookiecutter.project_slug }}")  # a RecipeError if the checks refused it
    assert capsys.readouterr().out.startswith(f"ok: {path}")


@pytest.mark.slow
@pytest.mark.matrix
def test_the_rehearsed_cp2_ranks_hold_the_activations_and_run_the_gathers_plan_counts() -> None:
    """cpu-cp-debug (2 ranks, cp=2) rehearsed with and without checkpointing: each rank's peak within 5% of plan's
    (activations of half the sequence and the gathered keys, values and mask), its gathers and reduce-scatters as
    counted."""
    for checkpointing in ("false", "true"):
        result = run_cli("rehearse", CP, "--strategy.activation_checkpointing", checkpointing, "--json")
        assert result.returncode == 0, result.stderr
        rehearsal = json.loads(result.stdout)
        plan = rehearsal["plan"]
        for rank in rehearsal["ranks"]:
            assert rank["peak_bytes"] == pytest.approx(plan["peak_bytes"], rel=0.05), (checkpointing, rank["rank"])
            counted = plan["collectives"]
            assert {name: rank["collectives"].get(name, 0) for name in counted} == counted, checkpointing
