"""Each strategy recipe of the language model's library builds the exact Fabric strategy it promises, and the library
holds a recipe per strategy. How any recipe becomes a strategy, and what is refused, is tested over the toy task in
tests/unit/test_strategy_recipes.py.

FSDP1 and DeepSpeed run only on GPUs (Fabric refuses them on CPU), so here their recipes are checked
by the strategy object and DeepSpeed config they produce; `scripts/gpu_check.sh` runs them on a GPU.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from helpers import RECIPES
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import CPUOffload, ShardingStrategy

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import Block


def recipe(name: str, *overrides: str) -> Recipe:
    return parse_recipe(["--config", str(RECIPES / f"{name}.yaml"), *overrides])


def build_strategy(config: Recipe):
    return strategy_for(config).fabric_strategy()


def deepspeed_config(config: Recipe) -> dict:
    return strategy_for(config).config_dict()


@pytest.mark.parametrize(
    ("name", "sharding", "offload", "mesh"),
    [
        ("fsdp1-node", ShardingStrategy.FULL_SHARD, False, None),
        ("fsdp1-shard-grad-op-node", ShardingStrategy.SHARD_GRAD_OP, False, None),
        ("fsdp1-hybrid-multinode", ShardingStrategy.HYBRID_SHARD, False, (4, 8)),
        ("fsdp1-offload-node", ShardingStrategy.FULL_SHARD, True, None),
    ],
)
def test_fsdp1_recipes_build_fabrics_fsdp_strategy(name: str, sharding: ShardingStrategy, offload: bool, mesh) -> None:
    strategy = build_strategy(recipe(name))
    assert type(strategy) is FSDPStrategy
    assert strategy.sharding_strategy == sharding
    assert strategy.cpu_offload == CPUOffload(offload_params=offload)
    assert strategy._state_dict_type == "sharded"
    assert strategy._process_group_backend == "nccl" and strategy._timeout == timedelta(minutes=30)
    assert strategy._fsdp_kwargs.get("device_mesh") == mesh
    # One FSDP unit, and one activation checkpoint, per transformer block.
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
    ("name", "micro_batch", "zero_extra"),
    [
        ("deepspeed-zero1-node", 8, {"stage": 1}),
        ("deepspeed-zero2-node", 8, {"stage": 2}),
        ("deepspeed-zero3-node", 4, {"stage": 3}),
        (
            "deepspeed-zero3-offload-node",
            1,
            {"stage": 3, "offload_optimizer": CPU_OFFLOAD, "offload_param": CPU_OFFLOAD},
        ),
        (
            "deepspeed-zero3-offload-multinode",
            1,
            {"stage": 3, "offload_optimizer": CPU_OFFLOAD, "offload_param": CPU_OFFLOAD},
        ),
        (
            "deepspeed-zero3-nvme-node",
            1,
            {"stage": 3, "offload_optimizer": NVME_OFFLOAD, "offload_param": NVME_OFFLOAD},
        ),
    ],
)
def test_deepspeed_recipes_give_the_exact_config_and_strategy(name: str, micro_batch: int, zero_extra: dict) -> None:
    config = deepspeed_config(recipe(name))
    expected = {
        **DEEPSPEED_BASE,
        "train_micro_batch_size_per_gpu": micro_batch,
        "zero_optimization": {"overlap_comm": True, "contiguous_gradients": True, **zero_extra},
    }
    if "nvme" in name:
        expected["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    assert config == expected

    strategy = build_strategy(recipe(name))
    assert type(strategy) is DeepSpeedStrategy
    assert strategy.config == expected
    assert strategy.process_group_backend == "nccl"


@pytest.mark.parametrize(
    ("name", "data_parallel", "tensor_parallel", "replicas"),
    [
        ("fsdp2-node", 8, 1, 1),
        ("hsdp-multinode", 32, 1, 4),  # one replica per node
        ("fsdp2-tp-multinode", 4, 8, 1),
        ("cpu-tp-debug", 2, 2, 1),
    ],
)
def test_model_parallel_recipes_build_the_device_mesh_sizes(
    name: str, data_parallel: int, tensor_parallel: int, replicas: int
) -> None:
    strategy = build_strategy(recipe(name))
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (data_parallel, tensor_parallel)
    assert strategy._parallelize_fn.keywords["replicas"] == replicas


@pytest.mark.parametrize(
    ("name", "data_parallel"), [("moe-30b-a3b-fsdp2-ep-node", 8), ("moe-30b-a3b-fsdp2-ep-multinode", 32)]
)
def test_the_30b_moe_recipes_split_experts_over_the_8_gpus_of_a_node(name: str, data_parallel: int) -> None:
    config = recipe(name)
    strategy = build_strategy(config)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (data_parallel, 1)
    assert strategy._parallelize_fn.keywords["config"].fsdp2.expert_parallel_size == config.devices == 8
    assert config.model.moe.num_experts == 128 and config.model.moe.top_k == 8


def test_hsdp_under_a_pipeline_replicates_each_stage_across_the_nodes_it_spans() -> None:
    # 4 nodes of 1 process, 2 stages: each stage spans 2 nodes, one replica on each.
    config = recipe("cpu-pp-debug", "--strategy.name", "hsdp", "--num_nodes", "4", "--devices", "1")
    strategy = build_strategy(config)
    assert (strategy._data_parallel_size, strategy.pipeline_parallel_size) == (2, 2)
    assert strategy._parallelize_fn.keywords["replicas"] == 2


def test_ddp_recipe_builds_ddp() -> None:
    assert type(build_strategy(recipe("ddp-node"))) is DDPStrategy


def test_tensor_parallel_over_heads_that_it_does_not_divide_is_refused() -> None:
    with pytest.raises(RecipeError, match=r"tensor_parallel_size=8 does not divide model\.n_head=12"):
        recipe("fsdp2-tp-multinode", "--model.n_head", "12", "--model.n_embd", "768")


def test_recipes_validate_explains_that_gpu_only_recipes_need_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "validate", "deepspeed-zero3-offload-multinode", "fsdp1-node", "cpu-tp-debug"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ok: ")]  # not the data lines
    assert (
        "strategy deepspeed" in lines[0] and "needs CUDA GPUs: Fabric runs strategy deepspeed only on GPUs" in lines[0]
    )
    assert "needs CUDA GPUs: Fabric runs strategy fsdp only on GPUs" in lines[1]
    assert "CPU, strategy fsdp2" in lines[2] and "needs" not in lines[2]


def test_the_library_has_a_recipe_per_strategy() -> None:
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert {"fsdp1-node", "hsdp-multinode", "deepspeed-zero3-offload-multinode", "fsdp2-tp-multinode"} <= names
    assert {"fsdp2-float8-node", "fsdp2-large-node", "cpu-tp-debug", "cpu-hsdp-debug"} <= names
    assert {"cpu-moe-debug", "cpu-moe-fsdp2-debug", "moe-30b-a3b-fsdp2-ep-node"} <= names
    assert "moe-30b-a3b-fsdp2-ep-multinode" in names
