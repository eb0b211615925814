"""A recipe builds the exact Fabric strategy its `strategy:` section names; impossible combinations get one line, exit 2.

FSDP1 and DeepSpeed run only on GPUs (Fabric refuses them on CPU), so here their recipes are checked by the
strategy object and DeepSpeed config they produce; `scripts/gpu_check.sh` runs them on a GPU. The machinery's own
test: its recipes are the toy task's (tests/toy-debug.yaml), so it runs in every project; the project's library
recipes are checked in tests/tasks/<task>/.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import RECIPES, TOY_RECIPE, fail_with, run_cli
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from toy_task.model import Block, Mlp

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.checks import check_hardware
from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.strategies.base import prepare_blocks
from {{ cookiecutter.package_name }}.training.run import build_fabric

pytestmark = pytest.mark.usefixtures("toy_task_here")

# The toy task's recipe on a node of 8 GPUs in bf16-mixed, as the GPU recipes of a library are.
ON_GPUS = ["--accelerator", "cuda", "--devices", "8", "--precision", "bf16-mixed"]
ON_GPUS += ["--strategy.process_group_backend", "nccl", "--strategy.timeout_minutes", "30"]
DEEPSPEED = ["--strategy.name", "deepspeed", "--strategy.deepspeed.stage"]
NVME = [*DEEPSPEED, "3", "--strategy.deepspeed.offload_optimizer", "nvme", "--strategy.deepspeed.offload_parameters"]
NVME += ["nvme", "--strategy.deepspeed.nvme_path", "/local_nvme"]
CPU_OFFLOADED = [*DEEPSPEED, "3", "--strategy.deepspeed.offload_optimizer", "cpu"]
CPU_OFFLOADED += ["--strategy.deepspeed.offload_parameters", "cpu"]


def recipe(*overrides: str) -> Recipe:
    """The toy recipe with these overrides."""
    return parse_recipe(["--config", str(TOY_RECIPE), *overrides])


def build_strategy(config: Recipe):
    return strategy_for(config).fabric_strategy()


def deepspeed_config(config: Recipe) -> dict:
    return strategy_for(config).config_dict()


@pytest.mark.parametrize(
    ("sharding", "offload", "nodes", "mesh"),
    [
        (ShardingStrategy.FULL_SHARD, False, 1, None),
        (ShardingStrategy.SHARD_GRAD_OP, False, 1, None),
        (ShardingStrategy.HYBRID_SHARD, False, 4, (4, 8)),
        (ShardingStrategy.FULL_SHARD, True, 1, None),
    ],
)
def test_fsdp1_recipes_build_fabrics_fsdp_strategy(sharding: ShardingStrategy, offload: bool, nodes: int, mesh) -> None:
    fsdp = ["--strategy.name", "fsdp", "--strategy.fsdp.sharding", sharding.name, "--num_nodes", str(nodes)]
    fsdp += ["--strategy.fsdp.cpu_offload", str(offload).lower(), "--strategy.activation_checkpointing", "true"]
    strategy = build_strategy(recipe(*ON_GPUS, *fsdp))
    assert type(strategy) is FSDPStrategy
    assert strategy.sharding_strategy == sharding
    assert strategy.cpu_offload == CPUOffload(offload_params=offload)
    assert strategy._state_dict_type == "sharded"
    assert strategy._process_group_backend == "nccl" and strategy._timeout == timedelta(minutes=30)
    assert strategy._fsdp_kwargs.get("device_mesh") == mesh
    # One FSDP unit, and one activation checkpoint, per block of the task's model.
    assert strategy._fsdp_kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {Block}


DEEPSPEED_BASE = {
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": True},
}
CPU_OFFLOAD = {"device": "cpu", "pin_memory": True}
NVME_OFFLOAD = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}


@pytest.mark.parametrize(
    ("overrides", "micro_batch", "zero_extra"),
    [
        ([*DEEPSPEED, "1"], 8, {"stage": 1}),
        ([*DEEPSPEED, "2"], 8, {"stage": 2}),
        ([*DEEPSPEED, "3"], 4, {"stage": 3}),
        (CPU_OFFLOADED, 1, {"stage": 3, "offload_optimizer": CPU_OFFLOAD, "offload_param": CPU_OFFLOAD}),
        (
            [*CPU_OFFLOADED, "--num_nodes", "4"],
            1,
            {"stage": 3, "offload_optimizer": CPU_OFFLOAD, "offload_param": CPU_OFFLOAD},
        ),
        (NVME, 1, {"stage": 3, "offload_optimizer": NVME_OFFLOAD, "offload_param": NVME_OFFLOAD}),
    ],
)
def test_deepspeed_recipes_give_the_exact_config_and_strategy(
    overrides: list[str], micro_batch: int, zero_extra: dict
) -> None:
    config = recipe(*ON_GPUS, *overrides, "--train.micro_batch_size", str(micro_batch))
    expected = {
        **DEEPSPEED_BASE,
        "train_micro_batch_size_per_gpu": micro_batch,
        "zero_optimization": {"overlap_comm": True, "contiguous_gradients": True, **zero_extra},
    }
    if overrides is NVME:
        expected["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    assert deepspeed_config(config) == expected

    strategy = build_strategy(config)
    assert type(strategy) is DeepSpeedStrategy
    assert strategy.config == expected
    assert strategy.process_group_backend == "nccl"


def test_deepspeed_config_follows_precision_and_clipping() -> None:
    config = deepspeed_config(recipe(*ON_GPUS, *DEEPSPEED, "2", "--precision", "32-true", "--train.grad_clip", "0.5"))
    assert "bf16" not in config and config["gradient_clipping"] == 0.5


@pytest.mark.parametrize(
    ("overrides", "data_parallel", "tensor_parallel", "replicas"),
    [
        (ON_GPUS, 8, 1, 1),
        ([*ON_GPUS, "--strategy.name", "hsdp", "--num_nodes", "4"], 32, 1, 4),  # one replica per node
        ([*ON_GPUS, "--strategy.fsdp2.tensor_parallel_size", "8", "--num_nodes", "4"], 4, 8, 1),
        (["--strategy.fsdp2.tensor_parallel_size", "2", "--devices", "4"], 2, 2, 1),  # 4 CPU processes
    ],
)
def test_model_parallel_recipes_build_the_device_mesh_sizes(
    overrides: list[str], data_parallel: int, tensor_parallel: int, replicas: int
) -> None:
    strategy = build_strategy(recipe(*overrides))
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (data_parallel, tensor_parallel)
    assert strategy._parallelize_fn.keywords["replicas"] == replicas


def test_hsdp_under_a_pipeline_replicates_each_stage_across_the_nodes_it_spans() -> None:
    # 4 nodes of 1 process, 2 stages: each stage spans 2 nodes, one replica on each.
    pipeline = ["--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_microbatches", "4"]
    config = recipe(
        *pipeline, "--train.micro_batch_size", "8", "--strategy.name", "hsdp", "--num_nodes", "4", "--devices", "1"
    )
    strategy = build_strategy(config)
    assert (strategy._data_parallel_size, strategy.pipeline_parallel_size) == (2, 2)
    assert strategy._parallelize_fn.keywords["replicas"] == 2


def test_ddp_recipe_builds_ddp() -> None:
    assert type(build_strategy(recipe(*ON_GPUS, "--strategy.name", "ddp"))) is DDPStrategy


def test_activation_checkpointing_wraps_every_kth_block_and_keeps_parameter_names() -> None:
    config = recipe("--model.depth", "5", "--strategy.activation_checkpointing", "true")
    config.strategy.activation_checkpointing_every = 2
    model = Mlp(config.model)
    names = list(model.state_dict())
    prepare_blocks(model, config.strategy)
    wrapped = [type(block).__name__ == "CheckpointWrapper" for block in model.blocks]
    assert wrapped == [True, False, True, False, True]
    assert list(model.state_dict()) == names  # checkpoints load with checkpointing on or off


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--strategy.fsdp2.tensor_parallel_size", "3"],
            "strategy.fsdp2.tensor_parallel_size=3 does not divide devices=2",
        ),
        (["--strategy.name", "hsdp"], "strategy.name=hsdp needs num_nodes >= 2"),
        (["--strategy.name", "deepspeed"], "strategy.name=deepspeed needs CUDA GPUs"),
        (["--strategy.name", "fsdp"], "strategy.name=fsdp needs CUDA GPUs"),
        (["--strategy.fsdp2.float8", "true"], "strategy.fsdp2.float8=true needs GPUs"),
        (["--strategy.fsdp2.cpu_offload", "true"], "strategy.fsdp2.cpu_offload=true needs CUDA GPUs"),
        (
            ["--strategy.name", "ddp", "--strategy.fsdp2.tensor_parallel_size", "2"],
            "applies only to strategy.name=fsdp2",
        ),
        (["--strategy.name", "ddp", "--strategy.meta_init", "true"], "strategy.meta_init=True applies only"),
    ],
)
def test_impossible_combinations_on_cpu_are_one_line_exit_2(
    overrides: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "run"
    argv = ["train", "--config", str(TOY_RECIPE), "--out_dir", str(out_dir), *overrides]
    assert message in fail_with(argv, capsys)
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--strategy.deepspeed.offload_optimizer", "nvme", "--strategy.deepspeed.nvme_path", "null"],
            "needs strategy.deepspeed.nvme_path",
        ),
        (
            ["--strategy.deepspeed.stage", "2", "--strategy.deepspeed.offload_parameters", "cpu"],
            "needs strategy.deepspeed.stage=3",
        ),
        (
            ["--strategy.deepspeed.stage", "2", "--strategy.deepspeed.offload_optimizer", "nvme"],
            "needs strategy.deepspeed.stage=3",
        ),
        (["--strategy.deepspeed.stage", "4"], "strategy.deepspeed.stage"),
        (["--strategy.deepspeed.offload_optimizer", "disk"], "strategy.deepspeed.offload_optimizer"),
    ],
)
def test_deepspeed_offload_mistakes_name_the_field(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--config", str(TOY_RECIPE), *ON_GPUS, *NVME, *overrides]
    assert message in fail_with(argv, capsys)


def test_meta_init_under_deepspeed_needs_stage_3() -> None:
    with pytest.raises(RecipeError, match=r"strategy\.meta_init=true needs strategy\.deepspeed\.stage=3"):
        recipe(*ON_GPUS, *DEEPSPEED, "2", "--strategy.meta_init", "true")
    assert recipe(*ON_GPUS, *CPU_OFFLOADED, "--strategy.meta_init", "true").strategy.meta_init


def test_hybrid_shard_on_one_node_and_tensor_parallel_over_the_models_dimension_are_refused() -> None:
    with pytest.raises(RecipeError, match=r"strategy\.fsdp\.sharding=HYBRID_SHARD needs num_nodes >= 2"):
        recipe(*ON_GPUS, "--strategy.name", "fsdp", "--strategy.fsdp.sharding", "HYBRID_SHARD", "--num_nodes", "1")
    with pytest.raises(RecipeError, match=r"tensor_parallel_size=8 does not divide model\.width=12"):
        recipe(*ON_GPUS, "--strategy.fsdp2.tensor_parallel_size", "8", "--model.width", "12")


@pytest.mark.parametrize("name", ["deepspeed", "fsdp"])
def test_gpu_only_strategy_with_auto_accelerator_is_refused_where_auto_means_cpu(name: str) -> None:
    config = recipe(
        *ON_GPUS, "--strategy.name", name, "--accelerator", "auto", "--devices", "2",
        "--strategy.process_group_backend", "null",
    )  # fmt: skip
    with pytest.raises(RecipeError, match=f"strategy.name={config.strategy.name} needs CUDA GPUs and this machine"):
        check_hardware(config, "cpu", None, found=True)
    if not torch.cuda.is_available():  # on this machine auto is cpu: the same line, before anything launches
        with pytest.raises(RecipeError, match="needs CUDA GPUs and this machine has none"):
            build_fabric(config, strategy_for(config), [])


def test_gpu_checks_refuse_bf16_and_float8_on_gpus_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RecipeError, match=r"precision=bf16-mixed needs a GPU with bf16 .* this GPU has 7.0"):
        check_hardware(recipe(*ON_GPUS), "cuda", (7, 0))
    float8 = recipe(*ON_GPUS, "--strategy.fsdp2.float8", "true")
    with pytest.raises(RecipeError, match=r"strategy.fsdp2.float8=true needs compute capability 8.9\+ .* has 8.0"):
        check_hardware(float8, "cuda", (8, 0))
    # torchao is the float8 extra, out of the default install: an H100 is refused without it, in one line that
    # names the extra, and accepted once it is there (both sides whether or not this machine has it).
    find_spec = importlib.util.find_spec
    for installed in (False, True):
        torchao = find_spec("json") if installed else None  # any module's spec stands for torchao's

        def find(name: str, *args: Any, torchao: Any = torchao) -> Any:
            return torchao if name == "torchao" else find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find)
        if installed:
            check_hardware(float8, "cuda", (9, 0))
        else:
            with pytest.raises(
                RecipeError, match=r"strategy\.fsdp2\.float8=true needs torchao: pip install -e '\.\[float8\]'$"
            ):
                check_hardware(float8, "cuda", (9, 0))


def test_recipes_validate_explains_that_gpu_only_recipes_need_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toy = yaml.safe_load(TOY_RECIPE.read_text())
    on_gpus = {"accelerator": "cuda", "devices": 8, "precision": "bf16-mixed"}
    strategies = {
        "deepspeed": {"name": "deepspeed", "process_group_backend": "nccl", "deepspeed": {"stage": 3}},
        "fsdp": {"name": "fsdp", "process_group_backend": "nccl"},
        "tp": {**toy["strategy"], "fsdp2": {"tensor_parallel_size": 2}},
    }
    paths = []
    for name, strategy in strategies.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**toy, **(on_gpus if name != "tp" else {}), "strategy": strategy}))
        paths.append(str(path))
    main(["recipes", "validate", *paths])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ok: ")]  # not the data lines
    assert (
        "strategy deepspeed" in lines[0] and "needs CUDA GPUs: Fabric runs strategy deepspeed only on GPUs" in lines[0]
    )
    assert "needs CUDA GPUs: Fabric runs strategy fsdp only on GPUs" in lines[1]
    assert "CPU, strategy fsdp2" in lines[2] and "needs" not in lines[2]


def test_every_library_recipe_loads_and_validates_with_its_layout() -> None:
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert all(isinstance(load_recipe(RECIPES / f"{name}.yaml"), Recipe) for name in names)
    result = run_cli("recipes", "validate", "cpu-hsdp-debug")
    assert result.returncode == 0 and "4 process(es) = 2 device(s) x 2 node(s), CPU, strategy hsdp" in result.stdout
