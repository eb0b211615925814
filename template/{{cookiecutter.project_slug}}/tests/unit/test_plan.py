"""`plan`: every strategy's memory, communication and step time for a model on a cluster, the one to pick, and
the recipe it writes (its model-state figures are checked against real per-rank bytes in tests/e2e/test_strategies.py).

The machinery's own test: it plans the toy task (tests/toy_task/, its sizing in sizing.py), so it runs in every
project; the project's task plans its own models and library in tests/tasks/<task>/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from helpers import TOY_RECIPE, cli_env, plan_json, recommended
from toy_task.sizing import MlpShape
from toy_task.task import VectorRegression

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.commands.plan import plan_device
from {{ cookiecutter.package_name }}.planner.hardware import INTERCONNECTS
from {{ cookiecutter.package_name }}.planner.pipeline import bubble_fraction, pieces_held
from {{ cookiecutter.package_name }}.planner.plan import CANDIDATES, Plan, estimate, plan, plan_inputs
from {{ cookiecutter.package_name }}.planner.report import written_recipe
from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe
from {{ cookiecutter.package_name }}.tasks import REGISTRY, Task, register

pytestmark = pytest.mark.usefixtures("toy_task_here")

STRATEGIES = [
    "ddp",
    "zero1",
    "zero2",
    "hsdp",
    "fsdp2",
    "zero3",
    "fsdp2_pp2",
    "fsdp2_pp2_zbv",
    "fsdp2_pp4",
    "fsdp2_pp4_zbv",
    "fsdp2_pp8",
    "fsdp2_pp8_zbv",
    "fsdp2_tp2",
    "fsdp2_tp4",
    "fsdp2_tp8",
    "fsdp2_pp2_tp8",
    "fsdp2_pp2_tp8_zbv",
    "fsdp2_pp4_tp8",
    "fsdp2_pp4_tp8_zbv",
    "fsdp2_pp8_tp8",
    "fsdp2_pp8_tp8_zbv",
    "zero3_offload",
    "zero3_nvme",
]
# The toy task's recipe on a node of 8 GPUs training in bf16-mixed: what plan weighs strategies for.
ON_GPUS = [str(TOY_RECIPE), "--accelerator", "cuda", "--devices", "8", "--precision", "bf16-mixed"]
ON_GPUS += ["--strategy.process_group_backend", "nccl"]
# A toy MLP of 21.5 B parameters (80 blocks of width 8192): too big for a whole copy per GPU.
BIG = ["--model.width", "8192", "--model.depth", "80"]


def test_a_small_model_on_a_node_of_80_gb_gpus_gets_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    assert recommended(capsys, *ON_GPUS, "--gpu", "A100-80GB", "--train.micro_batch_size", "8") == "ddp"


def test_a_model_too_big_for_whole_copies_on_8_nodes_gets_a_sharded_strategy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = plan_json(capsys, *ON_GPUS, *BIG, "--gpu", "H100", "--num_nodes", "8")
    options = {option["strategy"]: option for option in plan["options"]}
    assert plan["world_size"] == 64 and not options["ddp"]["fits"] and not options["zero1"]["fits"]
    # Sharded: a GPU holds at most an eighth of the model states a whole copy (ddp) holds.
    chosen = options[plan["recommended"]["strategy"]]
    assert chosen["model_state_bytes"] <= options["ddp"]["model_state_bytes"] / 8


def test_over_slow_links_between_nodes_a_pipeline_keeps_its_gathers_in_a_node_and_is_chosen(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fsdp2_pp8 on 8 nodes: each stage's 8 ranks are one node, so only activations cross the slow links. 8192
    vectors a micro-batch give the step enough compute that the pipeline's bound is its compute, on either link."""
    args = (*ON_GPUS, *BIG, "--train.micro_batch_size", "8192", "--gpu", "H100", "--num_nodes", "8", "--interconnect")
    fast, slow = plan_json(capsys, *args, "infiniband"), plan_json(capsys, *args, "ethernet")
    steps = {name: {o["strategy"]: o["step_time_lower_bound_s"] for o in plan["options"]}
             for name, plan in [("ib", fast), ("eth", slow)]}  # fmt: skip
    assert steps["eth"]["fsdp2"] / steps["ib"]["fsdp2"] == pytest.approx(400 / 12.5)  # its gathers cross the nodes
    assert steps["eth"]["fsdp2_pp8"] == pytest.approx(steps["ib"]["fsdp2_pp8"])  # its gathers stay in a node
    chosen = slow["recommended"]["strategy"]
    assert chosen.startswith("fsdp2_pp8") and 2 * steps["eth"][chosen] <= steps["eth"]["fsdp2"]
    assert f"against {steps['eth']['fsdp2']:.2f} s for fsdp2, the cheapest that fits" in slow["recommended"]["reason"]


def test_a_model_too_big_for_8_x_24_gb_gets_offload(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, *ON_GPUS, *BIG, "--gpu", "RTX-4090")
    assert plan["recommended"]["strategy"] == "zero3_offload"
    assert [option["strategy"] for option in plan["options"] if option["fits"]] == ["zero3_offload", "zero3_nvme"]
    # Without the host RAM for it (400 GiB of states per node), only NVMe is left.
    assert recommended(capsys, *ON_GPUS, *BIG, "--gpu", "RTX-4090", "--host_memory_gib", "256") == "zero3_nvme"


def test_a_pipeline_candidate_matches_a_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    """fsdp2_pp4_tp8 on 8 nodes x 8 GPUs: 4 stages of 20 toy blocks, each split over 8 GPUs and sharded over the 2
    copies of its stage; micro batch 8 in 8 pieces of one vector under 1F1B. The worst rank is the first: it holds
    4 pieces (the last one) and the input layer (the toy's sizes do not say which end holds what: half of the
    parameters outside the blocks on each)."""
    plan = plan_json(capsys, *ON_GPUS, *BIG, "--train.micro_batch_size", "8", "--gpu", "H100", "--num_nodes", "8")
    option = next(option for option in plan["options"] if option["strategy"] == "fsdp2_pp4_tp8")
    width, inputs, outputs = 8192, 8, 4
    # fc (width -> 2 width, biased) and proj (2 width -> width) split; proj's bias and the LayerNorm are not.
    block = (2 * width * width + 2 * width + 2 * width * width) // 8 + width + 2 * width
    outside = ((inputs * width + width) + (width * outputs + outputs)) // 2  # input layer, head: half on each end
    stage = 20 * block + outside
    assert option["parameters_bytes"] == option["gradients_bytes"] == 2 * stage / 2  # bf16, over 2 data-parallel ranks
    assert option["optimizer_bytes"] == 12 * stage / 2  # fp32 master weights, Adam's two moments
    assert option["pipeline"] == {
        "stages": 4,
        "schedule": "1F1B",
        "bubble_fraction": 3 / 11,  # (p - 1) / (m + p - 1)
        "pieces_held_by_first_stage": 4,  # min(m, p)
        "blocks_per_rank": 20,
        "worst_rank": 0,
        "p2p_elements_per_micro_batch": 2 * 8 * width,  # forward activations and backward gradients, b h
    }
    # Until the step's last piece the stage holds its 20 blocks and its end gathered (bf16; the end whole beside its
    # shard) and their gradients (fp32; the end's beside each piece's bf16 one); with one micro-batch a step no
    # gradient shard (fp32, fully_shard's) exists until the schedule has run.
    assert option["runtime_extra_terms"] == {
        "the stage's blocks, gathered until the step's last backward": 2 * 20 * block,
        "their unsharded gradients, summed over the pieces": 4 * 20 * block,
        "root (embeddings, head) gathered for the step": 2 * outside,
        "the root's gradients: their fp32 sum, a piece's own": (2 + 4) * outside,
        "gradient shards, made after the schedule": -4 * stage / 2,
    }
    zbv = next(option for option in plan["options"] if option["strategy"] == "fsdp2_pp4_tp8_zbv")
    assert zbv["pipeline"] == {
        "stages": 8,  # two per rank, in a V
        "schedule": "ZBVZeroBubble",
        "bubble_fraction": 0,  # 8 pieces >= 2p - 1 fill the V
        "pieces_held_by_first_stage": 4,
        "blocks_per_rank": 20,
        "worst_rank": 0,
        "p2p_elements_per_micro_batch": 2 * 2 * 8 * width,  # both stages send
    }
    bubbles = {o["strategy"]: o["pipeline"]["bubble_fraction"] for o in plan["options"] if o["pipeline"]}
    assert bubbles["fsdp2_pp2"] == 1 / 9 and bubbles["fsdp2_pp8"] == 7 / 15 and bubbles["fsdp2_pp8_zbv"] == 7 / 15


def test_bubble_and_held_pieces_of_each_schedule() -> None:
    assert bubble_fraction("GPipe", 4, 8) == bubble_fraction("1F1B", 4, 8) == 3 / 11
    assert bubble_fraction("Interleaved1F1B", 4, 8, stages_per_rank=2) == 3 / 22  # interleaving divides it by v
    # The weight halves of backward fill two thirds of 1F1B's bubble: 3 idle units of 1 in 8 pieces x 3 + 3.
    assert bubble_fraction("InterleavedZeroBubble", 4, 8) == 3 / 27
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, stages_per_rank=2) == 3 / 54
    # ZB-V idles only while fewer than 2p - 1 = 7 pieces fill its V.
    assert bubble_fraction("ZBVZeroBubble", 4, 8) == 0 and bubble_fraction("ZBVZeroBubble", 4, 4) == 3 / 7
    assert pieces_held("GPipe", 4, 8) == 8 and pieces_held("1F1B", 4, 8) == 4
    assert pieces_held("Interleaved1F1B", 4, 8, stages_per_rank=2) == 4 * (1 + 3 / 8)
    assert pieces_held("ZBVZeroBubble", 4, 8, stages_per_rank=2) == pieces_held("InterleavedZeroBubble", 4, 8) == 4


def test_the_json_lists_every_candidate_with_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, *ON_GPUS)
    assert {"parameters", "world_size", "options", "recommended"} <= set(plan)
    assert [option["strategy"] for option in plan["options"]] == STRATEGIES == [c.name for c in CANDIDATES]
    for option in plan["options"]:
        assert {
            "strategy",
            "model_state_bytes",
            "runtime_extra_bytes",
            "activation_bytes",
            "total_bytes",
            "fits",
            "comm_volume_vs_ddp",
        } <= set(option)
        used = option["model_state_bytes"] + option["runtime_extra_bytes"] + option["activation_bytes"]
        assert option["total_bytes"] == pytest.approx(used)
    assert {"strategy", "recipe", "reason"} <= set(plan["recommended"])
    comm = {option["strategy"]: option["comm_volume_vs_ddp"] for option in plan["options"]}
    assert comm["ddp"] == comm["zero1"] == comm["zero2"] == pytest.approx(1.0)  # the ZeRO paper, section 7
    assert comm["zero3"] == comm["fsdp2"] == pytest.approx(1.5)
    assert comm["fsdp2_tp2"] > comm["fsdp2"]  # plus tensor parallel's per-layer all-reduces
    hsdp = plan_json(capsys, *ON_GPUS, "--num_nodes", "4")["options"][3]
    assert hsdp["strategy"] == "hsdp" and hsdp["comm_volume_vs_ddp"] == pytest.approx(1.5 + 1 / 8)


def test_overrides_change_the_model_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    base = plan_json(capsys, *ON_GPUS)
    deeper = plan_json(capsys, *ON_GPUS, "--model.depth", "48", "--num_nodes", "2", "--precision", "bf16-true")
    assert deeper["parameters"] > base["parameters"] and deeper["world_size"] == 16
    assert plan_json(capsys, *ON_GPUS, "--parameters", "7e9")["parameters"] == 7_000_000_000


def test_a_cpu_recipe_speaks_of_cpu_processes_and_a_tiny_model_of_readable_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["plan", str(TOY_RECIPE)])
    out = capsys.readouterr().out
    assert "GPU(s)" not in out and "2 CPU process(es)" in out
    assert "0.00 B" not in out and "13.19 K parameters" in out and "KiB (2^10 bytes)" in out
    # The library's recipes are the project task's: none is named as where a toy recipe would start.
    assert "recommended: ddp: " in out


def test_write_fills_the_recommended_strategy_into_a_nested_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The planned recipe, its overrides included, with plan's strategy; DeepSpeed builds for CUDA only, so the
    written recipe is not rehearsed, and the line that says 'wrote' says so."""
    target = tmp_path / "mine.yaml"
    overrides = ["--data.samples", "256", "--train.learning_rate", "0.003", "--eval.every_steps", "3"]
    main(["plan", *ON_GPUS, *BIG, *overrides, "--gpu", "RTX-4090", "--write", str(target)])
    assert f"wrote {target} (strategy.name=deepspeed: not rehearsed: " in capsys.readouterr().out
    recipe = yaml.safe_load(target.read_text())
    assert target.read_text().startswith("# Written by")
    assert recipe["task"] == "vector_regression"  # written from the planned recipe, not the project task's library
    toy = yaml.safe_load(TOY_RECIPE.read_text())  # its data, train and eval sections kept, with the overrides
    kept = {key: value for key, value in toy["train"].items() if key not in ("learning_rate", "micro_batch_size")}
    assert kept and kept.items() <= recipe["train"].items()
    assert (recipe["data"]["samples"], recipe["train"]["learning_rate"]) == (256, 0.003)
    assert recipe["eval"]["every_steps"] == 3
    assert recipe["checkpoint"]["save_every_steps"] == toy["checkpoint"]["save_every_steps"]
    assert recipe["strategy"]["name"] == "deepspeed"
    assert recipe["strategy"]["deepspeed"] == {
        "stage": 3,
        "offload_optimizer": "cpu",
        "offload_parameters": "cpu",
        "nvme_path": None,
    }
    assert recipe["strategy"]["activation_checkpointing"] is False  # a vector's activations fit without
    assert (recipe["model"]["depth"], recipe["model"]["width"], recipe["devices"]) == (80, 8192, 8)
    assert "deepspeed_stage" not in recipe["strategy"] and "offload_optimizer" not in recipe["strategy"]
    assert load_recipe(target).strategy.deepspeed.stage == 3  # the recipe checks pass


def test_write_turns_a_recommended_pipeline_into_a_recipe_that_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over ethernet between 8 nodes a pipeline of 8 stages is chosen: the written recipe runs it, one vector a
    piece."""
    target = tmp_path / "mine.yaml"
    layout = ["--train.micro_batch_size", "8192", "--gpu", "H100", "--num_nodes", "8", "--interconnect", "ethernet"]
    main(["plan", *ON_GPUS, *BIG, *layout, "--write", str(target)])
    assert "recommended: fsdp2_pp8_zbv" in capsys.readouterr().out  # the layout's quicker schedule
    recipe = load_recipe(target)  # the recipe checks pass
    options = recipe.strategy.fsdp2
    layout = options.pipeline_parallel_size, options.pipeline_schedule, options.pipeline_stages_per_rank
    assert (*layout, options.tensor_parallel_size) == (8, "ZBVZeroBubble", 2, 1)
    assert options.pipeline_microbatches == recipe.train.micro_batch_size == 8192


class VectorRegressionUnsplit(VectorRegression):
    """The toy task with its size formulas but neither a tensor-parallel plan nor a pipeline split."""

    name = "vector_regression_unsplit"
    pipeline_blocks = Task.pipeline_blocks  # refuses: "has no pipeline split"

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        return {}


def test_a_task_that_cannot_split_its_model_is_offered_no_tensor_or_pipeline_layout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Over ethernet between 8 nodes the toy task gets a pipeline; the same model in a task that cannot split it gets
    none: each such candidate is n/a with the recipe checks' reason."""
    layout = ["--train.micro_batch_size", "8192", "--gpu", "H100", "--num_nodes", "8", "--interconnect", "ethernet"]
    assert recommended(capsys, *ON_GPUS, *BIG, *layout).startswith("fsdp2_pp8")
    register(VectorRegressionUnsplit)
    try:
        plan = plan_json(capsys, *ON_GPUS, *BIG, *layout, "--task", VectorRegressionUnsplit.name)
    finally:
        REGISTRY.pop(VectorRegressionUnsplit.name)
    options = {option["strategy"]: option for option in plan["options"]}
    split = [c.name for c in CANDIDATES if c.option.layout() != (1, 1)]
    for name in split:
        reason = options[name]["unavailable_reason"]
        assert not options[name]["fits"] and reason
        assert "has no pipeline split" in reason or "has no tensor-parallel plan" in reason, reason
    assert options["fsdp2_pp8_zbv"]["unavailable_reason"] == (
        "task vector_regression_unsplit has no pipeline split (set strategy.fsdp2.pipeline_parallel_size=1)"
    )
    assert plan["recommended"]["strategy"] not in split and options["fsdp2"]["available"]


def plan_for(*overrides: str) -> Plan:
    """The plan of the toy recipe on 8 H100s joined by InfiniBand, computed directly."""
    recipe = parse_recipe(["--config", *ON_GPUS, *overrides])
    device = plan_device(Namespace(gpu="H100", gpu_memory_gib=None), recipe)
    cost = MlpShape(recipe.model)
    return plan(plan_inputs(recipe, cost, cost.parameters(), device, INTERCONNECTS["infiniband"], 0.1))


def test_a_written_tensor_parallel_recipe_has_its_size_under_fsdp2() -> None:
    result = plan_for("--train.micro_batch_size", "8", "--train.grad_accum_steps", "4")
    tp4 = next(candidate for candidate in CANDIDATES if candidate.name == "fsdp2_tp4")
    chosen = Plan(result.inputs, result.estimates, estimate(tp4, result.inputs, 2), micro_batch=2, reason="")
    base = yaml.safe_load(TOY_RECIPE.read_text())
    recipe = written_recipe(base, {"depth": 24}, chosen)
    assert recipe["strategy"]["name"] == "fsdp2"
    assert recipe["strategy"]["fsdp2"] == {"tensor_parallel_size": 4, "float8": False}
    assert "tensor_parallel_size" not in recipe["strategy"]
    assert (recipe["devices"], recipe["num_nodes"], recipe["model"]["depth"]) == (8, 1, 24)
    # The global batch is kept: micro batch 8 x 4 accumulation becomes 2 x 16.
    assert (recipe["train"]["micro_batch_size"], recipe["train"]["grad_accum_steps"]) == (2, 16)


def test_plan_runs_without_importing_torch(toy_source: Path) -> None:
    code = (
        "import sys\n"
        "from {{ cookiecutter.package_name }}.cli import dispatch\n"
        f"dispatch(['plan', *{[*ON_GPUS, *BIG]!r}, '--json'])\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'\n"
    )
    env = cli_env(toy_source)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["recommended"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "X100"], "--gpu=X100: not in the table"),
        (["--margin", "1"], "--margin=1 must be in [0, 1)"),
        (["--gpu_memory_gib", "0"], "--gpu_memory_gib=0 must be > 0"),
        (["--interconnect", "carrier-pigeon"], "--interconnect=carrier-pigeon: choose"),
        (["--model.depth", "deep"], "model.depth"),
    ],
)
def test_impossible_settings_are_refused_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", *ON_GPUS, *args])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_under_bf16_mixed_fsdp2_is_a_16_bit_module_whose_gradients_are_reduced_in_fp32(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 7 B (26 blocks of width 8192) on 4 nodes of 8 H100: the sharded strategies' step is bound by the links
    # between nodes, not compute.
    layout = [*ON_GPUS, "--model.width", "8192", "--model.depth", "26", "--gpu", "H100", "--num_nodes", "4"]
    layout += ["--train.micro_batch_size", "1"]
    options = {option["strategy"]: option for option in plan_json(capsys, *layout)["options"]}
    fsdp2, zero3 = options["fsdp2"], options["zero3"]
    # Both gather bf16 weights and hold bf16 activations (fully_shard's MixedPrecisionPolicy; DeepSpeed's bf16 module).
    assert fsdp2["activation_bytes_without_checkpointing"] == zero3["activation_bytes_without_checkpointing"]
    assert fsdp2["activation_bytes_without_checkpointing"] < options["ddp"]["activation_bytes_without_checkpointing"]
    # The same volume; fsdp2 moves its reduce-scatter in fp32: (2 + 2 + 4) / (2 + 2 + 2) bytes per element.
    assert fsdp2["comm_volume_vs_ddp"] == zero3["comm_volume_vs_ddp"]
    assert fsdp2["step_time_lower_bound_s"] == pytest.approx(zero3["step_time_lower_bound_s"] * 8 / 6)
    # In fp32 every collective moves 4 bytes for both.
    options = {option["strategy"]: option for option in plan_json(capsys, *layout, "--precision", "32-true")["options"]}
    assert options["fsdp2"]["step_time_lower_bound_s"] == pytest.approx(options["zero3"]["step_time_lower_bound_s"])
