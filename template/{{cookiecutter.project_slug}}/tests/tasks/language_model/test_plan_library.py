"""`plan` of the language model: its reference shapes for a bare parameter count (`--parameters 70e9`), its library
recipes, the recipes it writes from them, its documented example and its model's refused settings. What plan
computes for any task is tested over the toy task in tests/unit/test_plan.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import PROJECT, RECIPES, cli_env, plan_json, recommended, run_cli

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.recipe.load import load_recipe

SHARDED = {"fsdp2", "zero3", "hsdp", "fsdp2_tp2", "fsdp2_tp4", "fsdp2_tp8"}


@pytest.mark.parametrize("recipe", sorted(path.stem for path in RECIPES.glob("*.yaml")))
def test_every_library_recipe_is_planned(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, recipe)
    assert plan["options"] and all(option["total_bytes"] > 0 for option in plan["options"])


def test_an_adapter_recipe_is_planned_with_a_frozen_base_that_holds_weights_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """LoRA on Llama-3-8B, rank 16 on the seven projections of 32 blocks: 41.9 M adapters train, the 8.03 B base is
    frozen. Under bf16-mixed the base stays fp32 (4 bytes each) with no gradient or optimizer state; the adapters
    hold the paper's 2 + 2 + 12 bytes. So it fits one 80 GB GPU, which the whole model's 16 bytes would not."""
    plan = plan_json(capsys, "lora-llama-8b-single-gpu")
    width, kv_width, hidden, blocks = 4096, 1024, 14336, 32
    adapters = 16 * blocks * (2 * (width + width) + 2 * (width + kv_width) + 3 * (width + hidden))
    base = plan["parameters"] - adapters
    ddp = next(option for option in plan["options"] if option["strategy"] == "ddp")
    assert plan["trained_parameters"] == adapters == 41_943_040 and base == pytest.approx(8.03e9, rel=1e-3)
    assert ddp["parameters_bytes"] == pytest.approx(4 * base + 2 * adapters)
    assert ddp["gradients_bytes"] == pytest.approx(2 * adapters)
    assert ddp["optimizer_bytes"] == pytest.approx(12 * adapters)
    assert plan["recommended"]["strategy"] == "ddp" and ddp["fits"]


def test_a_125m_model_on_a_node_of_80_gb_gpus_gets_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    assert recommended(capsys, "--parameters", "125e6", "--gpu", "A100-80GB", "--train.micro_batch_size", "8") == "ddp"


def test_70b_on_8_nodes_of_8_x_80_gb_gets_a_sharded_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--parameters", "70e9", "--gpu", "H100", "--num_nodes", "8")
    assert plan["world_size"] == 64 and plan["recommended"]["strategy"] in SHARDED
    fits = {option["strategy"]: option["fits"] for option in plan["options"]}
    assert not fits["ddp"] and not fits["zero1"]


def test_over_slow_links_between_nodes_a_pipeline_keeps_its_gathers_in_a_node_and_is_chosen(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8 pipeline stages on 8 nodes: each stage's 8 ranks are one node, so only activations cross the slow links. At
    micro batch 1 (one piece) 1F1B cannot run 8 stages (torch's schedule takes at least a piece a stage) and ZB-V can:
    fsdp2_pp8_tp8_zbv, whose stage holds its blocks gathered and their fp32 gradients until the step's last piece and
    fits without activation checkpointing split over 8 GPUs, is chosen."""
    args = ("--parameters", "70e9", "--gpu", "H100", "--num_nodes", "8", "--interconnect")
    fast, slow = plan_json(capsys, *args, "infiniband"), plan_json(capsys, *args, "ethernet")
    steps = {name: {o["strategy"]: o["step_time_lower_bound_s"] for o in plan["options"]}
             for name, plan in [("ib", fast), ("eth", slow)]}  # fmt: skip
    assert steps["eth"]["fsdp2"] / steps["ib"]["fsdp2"] == pytest.approx(400 / 12.5)  # its gathers cross the nodes
    assert steps["eth"]["fsdp2_pp8_tp8_zbv"] == pytest.approx(steps["ib"]["fsdp2_pp8_tp8_zbv"])  # they stay in a node
    assert fast["recommended"]["strategy"] == "fsdp2"  # less than twice as quick: the cheapest stays
    assert 2 * steps["ib"]["fsdp2_pp8_tp8_zbv"] > steps["ib"]["fsdp2"]
    options = {option["strategy"]: option for option in slow["options"]}
    for one_f_one_b in ("fsdp2_pp8", "fsdp2_pp8_tp8"):
        assert (
            options[one_f_one_b]["unavailable_reason"]
            == "1F1B feeds at least 8 pieces (one sample each): micro batch 1 gives 1"
        )
    assert options["fsdp2_pp8_zbv"]["activation_checkpointing"]
    assert not options["fsdp2_pp8_tp8_zbv"]["activation_checkpointing"] and options["fsdp2_pp8_tp8_zbv"]["fits"]
    assert slow["recommended"]["strategy"] == "fsdp2_pp8_tp8_zbv"
    assert "bound at 13.99 s against 358.40 s for fsdp2, the cheapest that fits" in slow["recommended"]["reason"]


def test_70b_on_one_node_of_8_x_24_gb_gets_offload(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--parameters", "70e9", "--gpu", "RTX-4090")
    assert plan["recommended"]["strategy"] == "zero3_offload"
    assert plan["recommended"]["activation_checkpointing"] is True
    assert [option["strategy"] for option in plan["options"] if option["fits"]] == ["zero3_offload", "zero3_nvme"]
    # Without the host RAM for it, only NVMe is left.
    assert recommended(capsys, "--parameters", "70e9", "--gpu", "RTX-4090", "--host_memory_gib", "512") == "zero3_nvme"


def test_a_model_whose_single_layer_does_not_fit_gets_tensor_or_context_parallel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 262144 tokens through a layer with a 16x-wide MLP: one layer's activations alone exceed 80 GB, unless tensor
    # parallel splits the layer or context parallel the sequence.
    long_and_wide = ["--model.n_layer", "2", "--model.n_embd", "4096", "--model.n_head", "32", "--model.mlp_ratio"]
    long_and_wide += ["16", "--model.vocab_size", "256", "--model.block_size", "262144", "--gpu", "H100"]
    plan = plan_json(capsys, *long_and_wide)
    usable = plan["device"]["usable_bytes"]
    for option in plan["options"]:
        if "_tp" not in option["strategy"] and "_cp" not in option["strategy"]:
            # even checkpointed, one rebuilt layer is too much (pipelines too)
            assert option["activation_bytes_with_checkpointing"] > usable and not option["fits"], option["strategy"]
    recommended = plan["recommended"]
    assert recommended["tensor_parallel_size"] > 1 or recommended["context_parallel_size"] > 1


def test_the_70b_recipes_pipeline_candidate_matches_a_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    """fsdp2_pp4_tp8 on 8 nodes x 8 GPUs: 4 stages of Llama-70B blocks (19, 21, 21, 19: the embedding and the head
    weigh about a block each), each split over 8 GPUs and sharded over the 2 copies of its stage; micro batch 8 in 8
    pieces of one sequence under 1F1B. The worst rank is the last: 19 blocks, the head and the loss's logits."""
    plan = plan_json(capsys, str(RECIPES / "llama-70b-pp-fsdp2-tp-multinode.yaml"), "--gpu", "H100")
    option = next(option for option in plan["options"] if option["strategy"] == "fsdp2_pp4_tp8")
    width, kv_width, hidden, vocab = 8192, 1024, 28672, 128256
    block = (2 * width * width + 2 * width * kv_width + 3 * width * hidden) // 8 + 2 * width  # norms are not split
    outside = vocab * width + width  # the head and the final norm, not split
    stage = 19 * block + outside
    assert option["parameters_bytes"] == option["gradients_bytes"] == 2 * stage / 2  # bf16, over 2 data-parallel ranks
    assert option["optimizer_bytes"] == 12 * stage / 2  # fp32 master weights, Adam's two moments
    assert option["pipeline"] == {
        "stages": 4,
        "schedule": "1F1B",
        "bubble_fraction": 3 / 11,  # (p - 1) / (m + p - 1)
        "pieces_held_by_first_stage": 4,  # min(m, p)
        "blocks_per_rank": 19,
        "worst_rank": 3,
        "p2p_elements_per_micro_batch": 2 * 8192 * 8 * width,  # forward activations and backward gradients, s b h
    }
    # Until the step's last piece the stage holds its 19 blocks and the head gathered (bf16; the head whole beside its
    # shard) and their gradients (fp32; the head's beside each piece's bf16 one); the gradient shards of the step's
    # earlier micro-batches too (8 a step).
    assert option["runtime_extra_terms"] == {
        "the stage's blocks, gathered until the step's last backward": 2 * 19 * block,
        "their unsharded gradients, summed over the pieces": 4 * 19 * block,
        "root (embeddings, head) gathered for the step": 2 * outside,
        "the root's gradients: their fp32 sum, a piece's own": (2 + 4) * outside,
    }
    zbv = next(option for option in plan["options"] if option["strategy"] == "fsdp2_pp4_tp8_zbv")
    assert zbv["pipeline"] == {
        "stages": 8,  # two per rank, in a V
        "schedule": "ZBVZeroBubble",
        "bubble_fraction": 0,  # 8 pieces >= 2p - 1 fill the V
        "pieces_held_by_first_stage": 4,
        "blocks_per_rank": 18,  # rank 0: the first stage and the last, 9 blocks each beside the embedding or head
        "worst_rank": 0,
        "p2p_elements_per_micro_batch": 2 * 2 * 8192 * 8 * width,  # both stages send
    }
    bubbles = {o["strategy"]: o["pipeline"]["bubble_fraction"] for o in plan["options"] if o["pipeline"]}
    assert bubbles["fsdp2_pp2"] == 1 / 9 and bubbles["fsdp2_pp8"] == 7 / 15 and bubbles["fsdp2_pp8_zbv"] == 7 / 15


def assert_shown_as_printed(shown: object, printed: object, where: str) -> None:
    """The documented example (docs/strategies.md) is the command's output trimmed: the same keys in the same order at every level,
    each value as printed, a list its first elements, a string ending in '...' a shortened one."""
    if isinstance(shown, dict):
        assert isinstance(printed, dict) and list(shown) == list(printed), f"{where}: {list(shown)} != {list(printed)}"
        for key in shown:
            assert_shown_as_printed(shown[key], printed[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(printed, list) and printed, where
        for index, element in enumerate(shown):  # an option is shown with the one of its strategy
            same = [item for item in printed if isinstance(item, dict) and item.get("strategy") == element["strategy"]]
            assert_shown_as_printed(element, same[0] if same else None, f"{where}[{index}]")
    elif isinstance(shown, str) and shown.endswith("..."):
        kept = [part for part in shown.split("...") if part]
        assert isinstance(printed, str) and all(part in printed for part in kept), f"{where}: {printed!r}"
    else:
        assert shown == printed, f"{where}: docs/strategies.md shows {shown!r}, the command prints {printed!r}"


def test_the_documented_json_example_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    page = (PROJECT / "docs" / "strategies.md").read_text()
    found = re.search(r"`--json` prints the plan as data \(here `plan ([^`]+)`.*?```json\n(.*?)```", page, re.S)
    assert found, "docs/strategies.md's plan --json example"
    command, example = found.groups()
    arguments = command.split()
    assert arguments[-1] == "--json"
    assert_shown_as_printed(json.loads(example), plan_json(capsys, *arguments[:-1]), "plan")


def test_a_cpu_recipe_speaks_of_cpu_processes_and_a_tiny_model_of_readable_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["plan", "cpu-debug"])
    out = capsys.readouterr().out
    assert "GPU(s)" not in out and "2 CPU process(es)" in out
    assert "0.00 B" not in out and "875.26 K parameters" in out and "MiB (2^20 bytes)" in out
    assert "recommended: ddp (from recipe cpu-debug)" in out


def test_write_fills_the_recommended_strategy_into_a_nested_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "mine.yaml"
    main(["plan", "--parameters", "70e9", "--gpu", "RTX-4090", "--write", str(target)])
    assert f"wrote {target}" in capsys.readouterr().out
    recipe = yaml.safe_load(target.read_text())
    assert target.read_text().startswith("# Written by")
    assert recipe["strategy"]["name"] == "deepspeed"
    assert recipe["strategy"]["deepspeed"] == {
        "stage": 3,
        "offload_optimizer": "cpu",
        "offload_parameters": "cpu",
        "nvme_path": None,
    }
    assert recipe["strategy"]["activation_checkpointing"] is True
    assert (recipe["model"]["n_layer"], recipe["model"]["n_embd"], recipe["devices"]) == (80, 8192, 8)
    assert "deepspeed_stage" not in recipe["strategy"] and "offload_optimizer" not in recipe["strategy"]


@pytest.mark.slow
@pytest.mark.matrix  # rehearses the 70B pipeline's ranks before writing: minutes
def test_write_turns_a_recommended_pipeline_into_a_recipe_that_loads(tmp_path: Path) -> None:
    """The 70B recipe's activations fit only in a pipeline's stages: the written recipe runs one, one sample a piece,
    and its rehearsed ranks fit (plan sizes each rank: 2 stages of 40 blocks under 1F1B, 68.1 GiB on the last; the
    zero-bubble schedules hold every piece's activations whether checkpointed or not, far more)."""
    target = tmp_path / "mine.yaml"
    # --write rehearses the written layout's ranks first and refuses a peak above the GPU's memory
    recipe_path = str(RECIPES / "llama-70b-pp-fsdp2-tp-multinode.yaml")
    result = run_cli("plan", recipe_path, "--gpu", "H100", "--write", str(target), timeout=1800)
    assert result.returncode == 0, result.stderr
    assert "recommended: fsdp2_pp2_tp8 " in result.stdout
    recipe = load_recipe(target)  # the recipe checks pass
    options = recipe.strategy.fsdp2
    layout = options.pipeline_parallel_size, options.pipeline_schedule, options.pipeline_stages_per_rank
    assert (*layout, options.tensor_parallel_size) == (2, "1F1B", 1, 8)
    assert options.pipeline_microbatches == recipe.train.micro_batch_size == 8
    assert recipe.eval.every_steps == 2000  # the library recipe's validation, which runs through the pipeline


def test_plan_of_the_language_model_runs_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from {{ cookiecutter.package_name }}.cli import dispatch\n"
        "dispatch(['plan', 'fsdp2-large-node', '--json'])\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["recommended"]


def test_a_head_count_that_does_not_divide_the_width_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "fsdp2-node", "--model.n_head", "7"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2
    assert err.startswith("error: ") and "n_head" in err and len(err.splitlines()) == 1
