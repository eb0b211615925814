"""`plan` of a mixture of experts (planner/experts.py): the all-to-all it counts, the dispatch buffers in the
activations, the expert-parallel degrees it offers and recommends, and the recipe it writes; in-process, no rank runs
(the rehearsal that measures the same: test_rehearse_library.py)."""

from __future__ import annotations

import dataclasses
from argparse import Namespace

import pytest
import yaml
from helpers import RECIPES, plan_json

from {{ cookiecutter.package_name }}.commands.plan import plan_device
from {{ cookiecutter.package_name }}.planner import experts
from {{ cookiecutter.package_name }}.planner.hardware import INTERCONNECTS
from {{ cookiecutter.package_name }}.planner.options import PlanOption
from {{ cookiecutter.package_name }}.planner.plan import Plan, plan, plan_inputs
from {{ cookiecutter.package_name }}.planner.report import written_recipe
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.tasks import task_for
from {{ cookiecutter.package_name }}.tasks.base import ExpertSizes
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import Shape, layer_activations

MOE = str(RECIPES / "cpu-moe-debug.yaml")  # 4 layers of 4 experts (top-2, width 128, expert hidden 128), 2 ranks
DENSE = str(RECIPES / "cpu-llama-debug.yaml")
# A Llama of 24 layers of width 2048 in bf16-mixed on H100s, and as a 14.5 B-parameter mixture of 64 experts (top-6).
LARGE = ["--accelerator", "cuda", "--precision", "bf16-mixed", "--strategy.process_group_backend", "nccl"]
LARGE += ["--model.n_embd", "2048", "--model.n_head", "16", "--model.n_kv_head", "16", "--model.n_layer", "24"]
LARGE += ["--model.block_size", "4096", "--model.vocab_size", "102400", "--train.micro_batch_size", "1"]
LARGE_MOE = [MOE, *LARGE, "--model.moe.num_experts", "64", "--model.moe.top_k", "6"]
LARGE_MOE += ["--model.moe.expert_intermediate_size", "1408"]


def shape_of(recipe: str = MOE) -> Shape:
    """The language model's sizing shape of a recipe."""
    cost = task_for(parse_recipe(["--config", recipe])).model_cost()
    assert isinstance(cost, Shape)
    return cost


def test_the_task_hands_plan_its_routed_experts_and_a_dense_model_none() -> None:
    width, hidden, experts_per_layer, top_k, sequence = 128, 128, 4, 2, 128
    assert shape_of().expert_sizes() == ExpertSizes(
        layers=4,
        experts=experts_per_layer,
        layer_parameters=3 * width * hidden * experts_per_layer,  # gate, up, down of every routed expert
        row_elements_per_sample=sequence * top_k * width,
    )
    assert shape_of(DENSE).expert_sizes() is None


def test_a_layer_of_experts_holds_its_dispatched_rows_and_their_outputs_beside_a_dense_mlps_activations() -> None:
    """Beyond a dense SwiGLU of the active width: the rows sorted by expert and the experts' outputs, each of
    micro-batch x sequence x top_k rows of the width, in the compute dtype."""
    moe = shape_of()
    dense = dataclasses.replace(moe, experts=0, experts_per_token=0, expert_hidden=0, shared_hidden=0)
    rows = 8 * 128 * 2
    for precision, element in (("32-true", 4), ("bf16-true", 2)):
        extra = layer_activations(moe, 8, precision) - layer_activations(dense, 8, precision)
        assert extra == 2 * rows * 128 * element, precision


def test_the_exchanges_counted_per_layer_and_micro_batch_are_the_rehearsals() -> None:
    """One exchange of counts and 4 of rows per layer and micro-batch; checkpointing recomputes the forward's 2 and its
    counts. A degree short of every data-parallel rank shards each layer's experts apart: one more unit per block."""
    cost, option = shape_of(), PlanOption("sharded", stage=3, why="", splits_experts=True, expert_parallel=2)
    assert experts.expert_collectives(cost, option, 3, 0) == {"alltoall": 12, "all_to_all_single": 48}
    assert experts.expert_collectives(cost, option, 3, 4) == {"alltoall": 24, "all_to_all_single": 72}
    assert experts.expert_collectives(cost, dataclasses.replace(option, expert_parallel=1), 3, 0) == {}
    assert experts.expert_collectives(shape_of(DENSE), option, 3, 0) == {}
    assert (experts.expert_units(cost, option, 2), experts.expert_units(cost, option, 4)) == (0, 4)
    assert experts.exchanged_elements(cost, option, 8, checkpointing=False) == 4 * 4 * 8 * 128 * 2 * 128


def test_an_exchange_inside_a_node_runs_on_its_links_and_one_across_nodes_at_the_networks_pace() -> None:
    """Balanced routing: a rank keeps 1/e of its rows; the peers in its node and those beyond are reached at once."""
    total, intra, across = 1.6e9, 400e9, 50e9
    inside = PlanOption("sharded", stage=3, why="", expert_parallel=4)
    assert experts.exchange_seconds(total, inside, 8, intra, across) == pytest.approx(total * 3 / 4 / intra)
    spanning = dataclasses.replace(inside, expert_parallel=16)
    assert experts.exchange_seconds(total, spanning, 8, intra, across) == pytest.approx(total * 8 / 16 / across)
    assert (experts.spans_nodes(inside, 8), experts.spans_nodes(spanning, 8)) == (False, True)


def test_a_degree_gathers_only_its_local_experts_and_none_when_it_holds_them_whole() -> None:
    cost, option = shape_of(), PlanOption("sharded", stage=3, why="", expert_parallel=2)
    routed = 3 * 128 * 128 * 4
    assert experts.not_gathered(cost, option, data_parallel=4) == routed / 2
    assert experts.not_gathered(cost, option, data_parallel=2) == routed


def test_a_mixture_of_experts_is_offered_each_degree_dividing_its_experts_and_ranks_and_a_dense_model_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def offered(*args: str) -> list[str]:
        return [option["strategy"] for option in plan_json(capsys, *args)["options"] if "_ep" in option["strategy"]]

    # fsdp2 and each fsdp2_tpT: tensor parallel's ranks share out the routed rows and hold the experts as data-parallel
    # ranks do, so the degrees divide the data x tensor-parallel ranks (token_split.py)
    sharding = ["fsdp2", "fsdp2_tp2", "fsdp2_tp4", "fsdp2_tp8"]
    assert offered(MOE) == ["fsdp2_ep2", "fsdp2_tp2_ep2", "fsdp2_tp4_ep2", "fsdp2_tp8_ep2"]
    assert offered(MOE, "--devices", "8") == [f"{o}_ep{d}" for o in sharding for d in (2, 4)]  # 4 experts: no 8
    assert offered(MOE, "--devices", "6") == [f"{o}_ep2" for o in sharding]  # 4 does not divide 6 ranks
    assert offered(DENSE, "--devices", "8") == []
    options = {option["strategy"]: option for option in plan_json(capsys, MOE)["options"]}
    sharded, split = options["fsdp2"], options["fsdp2_ep2"]
    assert split["model_state_bytes"] == sharded["model_state_bytes"]  # every parameter still over both ranks
    assert split["runtime_extra_bytes"] < sharded["runtime_extra_bytes"]  # each rank's experts are never gathered


def test_plan_recommends_the_quickest_degree_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """On a node of 8 H100s fsdp2 is the cheapest that fits without checkpointing, and gathering all 64 experts of
    each layer is slower than exchanging the routed rows: its quickest degree, all 8 GPUs, is taken. On 4 nodes the
    cheapest is zero2 (less volume than sharding), and a degree whose bound is less than half of its is taken
    instead, as a pipeline would be: hsdp_ep8, each node's 8 GPUs holding 1/8 of the experts, the rows crossing by
    all-to-all on the node's links, the nodes replicating the experts; fsdp2_ep32's ranks hold theirs whole and
    gather none, but its rows cross the network."""
    result = plan_json(capsys, *LARGE_MOE, "--devices", "8")
    steps = {o["strategy"]: o["step_time_lower_bound_s"] for o in result["options"] if o["fits"]}
    degrees = {name: seconds for name, seconds in steps.items() if name.startswith("fsdp2_ep")}
    assert list(degrees) == ["fsdp2_ep2", "fsdp2_ep4", "fsdp2_ep8"]
    assert result["recommended"]["strategy"] == min(degrees, key=lambda name: degrees[name]) == "fsdp2_ep8"
    assert result["recommended"]["expert_parallel_size"] == 8
    assert "for fsdp2, the cheapest that fits" in result["reason"] and "all-to-all" in result["reason"]
    nodes = plan_json(capsys, *LARGE_MOE, "--devices", "8", "--num_nodes", "4")
    steps = {o["strategy"]: o["step_time_lower_bound_s"] for o in nodes["options"]}
    assert nodes["recommended"]["strategy"] == "hsdp_ep8" and "for zero2, the cheapest that fits" in nodes["reason"]
    assert nodes["recommended"]["expert_parallel_size"] == 8
    assert 2 * steps["hsdp_ep8"] <= steps["zero2"] and steps["hsdp_ep8"] < steps["fsdp2_ep32"]
    assert [name for name in steps if name.startswith("hsdp_ep")] == ["hsdp_ep2", "hsdp_ep4", "hsdp_ep8"]  # in a node


def large_plan(*args: str) -> Plan:
    """A recipe and overrides planned directly on H100s joined by InfiniBand."""
    recipe = parse_recipe(["--config", *args])
    cost = task_for(recipe).model_cost()
    assert cost is not None
    device = plan_device(Namespace(gpu="H100", gpu_memory_gib=None), recipe)
    return plan(plan_inputs(recipe, cost, cost.parameters(), device, INTERCONNECTS["infiniband"], 0.1))


def test_the_written_recipe_sets_the_expert_parallel_size_and_a_dense_one_none() -> None:
    base = yaml.safe_load((RECIPES / "cpu-moe-debug.yaml").read_text())
    result = large_plan(*LARGE_MOE, "--devices", "8")
    assert result.recommended is not None and result.recommended.candidate.name == "fsdp2_ep8"
    recipe = written_recipe(base, {}, result)
    assert recipe["strategy"]["name"] == "fsdp2"
    assert recipe["strategy"]["fsdp2"] == {"tensor_parallel_size": 1, "float8": False, "expert_parallel_size": 8}
    dense = large_plan(DENSE, *LARGE, "--devices", "8")
    assert dense.recommended is not None and dense.recommended.candidate.option.expert_parallel == 1
    assert "expert_parallel_size" not in (written_recipe(base, {}, dense)["strategy"].get("fsdp2") or {})
