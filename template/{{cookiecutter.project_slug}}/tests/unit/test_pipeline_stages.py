"""Pipeline stages: where the blocks are split, what each stage builds, and the pipeline options a recipe may ask."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import RECIPES, fail_with

from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.strategies.pipeline import PipelineRank, balanced_split, build_stages, stage_split
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model

CONFIG = ModelConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)


def test_a_balanced_split_weighs_the_embeddings_and_the_head() -> None:
    assert balanced_split([10, 10, 10, 10], first=0, last=0, stages=2) == [2, 2]
    assert balanced_split([10, 10, 10, 10], first=25, last=5, stages=2) == [1, 3]  # 35 and 35 parameters
    assert balanced_split([10, 10, 10, 10], first=0, last=0, stages=4) == [1, 1, 1, 1]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_stages_keep_the_whole_models_names_and_weights_and_chain_to_its_output(arch: str) -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "arch": arch, "bias": False})
    torch.manual_seed(0)
    whole = build_model(config)
    torch.manual_seed(0)
    first, last = build_stages(partial(build_model, config), [1, 3], [0, 1], on_meta=False)
    assert [name for name, _ in first.named_parameters()][-1].startswith("blocks.0.")
    assert next(name for name, _ in last.named_parameters()).startswith("blocks.1.")
    together = PipelineRank([first, last]).state_dict()
    assert together.keys() == whole.state_dict().keys()
    assert all(torch.equal(together[name], value) for name, value in whole.state_dict().items())
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(last(first(tokens)), whole(tokens))


def test_a_stage_built_on_the_meta_device_holds_only_its_own_blocks() -> None:
    (stage,) = build_stages(partial(build_model, CONFIG), [2, 2], [1], on_meta=True)
    assert {name.split(".")[0] for name, _ in stage.named_parameters()} == {"blocks", "norm", "lm_head"}
    assert stage.blocks.indices() == [2, 3] and all(p.is_meta for p in stage.parameters())


def test_mfu_under_a_pipeline_counts_every_stages_flops_once_per_token() -> None:
    """The FLOPs per token MFU is computed from are the whole model's: the sum of what each stage's forward and
    backward run (torch's FLOP counter, on the meta device), not one stage's; and each token is counted once per
    data-parallel replica, not once per stage's rank."""
    from lightning.fabric.utilities.throughput import measure_flops

    recipe = load_recipe(RECIPES / "cpu-pp-debug.yaml")
    strategy = strategy_for(recipe)
    task, tokens = strategy.task, recipe.model.block_size
    first, last = build_stages(task.build_model, stage_split(task.build_model, 2, []), [0, 1], on_meta=True)
    with torch.device("meta"):
        inputs = torch.zeros(1, tokens, dtype=torch.long)
        hidden = torch.zeros(1, tokens, recipe.model.n_embd, requires_grad=True)  # the gradient goes back a stage
    stage_flops = [
        measure_flops(first, lambda: first(inputs), lambda output: output.sum()) / tokens,
        measure_flops(last, lambda: last(hidden), lambda output: output.sum()) / tokens,
    ]
    assert min(stage_flops) > 0
    assert task.flops_per_unit() == pytest.approx(sum(stage_flops), rel=1e-9)
    assert strategy.data_parallel_size() == recipe.world_size // strategy.pipeline_parallel_size


ZERO_BUBBLE_IN_5_PIECES = [
    "--strategy.fsdp2.pipeline_schedule", "InterleavedZeroBubble", "--train.micro_batch_size", "10",
    "--strategy.fsdp2.pipeline_microbatches", "5",
]  # fmt: skip
IN_2_ROUNDS = "in 2 rounds of pipeline_parallel_size=2, which must divide them (choose from [1, 2, 10])"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--strategy.fsdp2.pipeline_microbatches", "3"], "pipeline_microbatches=3 must divide"),
        (["--strategy.fsdp2.pipeline_split", "[1,2]"], "pipeline_split=[1, 2] must give each of the 2 stages"),
        (["--strategy.fsdp2.pipeline_schedule", "Interleaved1F1B"], "pipeline_stages_per_rank=1"),
        (["--strategy.fsdp2.pipeline_schedule", "ZBVZeroBubble"], "pipeline_schedule=ZBVZeroBubble holds 2 per rank"),
        (ZERO_BUBBLE_IN_5_PIECES, IN_2_ROUNDS),
        (["--strategy.fsdp2.pipeline_parallel_size", "3"], "pipeline_parallel_size=3 x tensor_parallel_size=1"),
        (["--lora.rank", "4"], "lora.rank=4 does not run under pipeline parallel"),
        (["--strategy.name", "hsdp", "--num_nodes", "2", "--devices", "1"], "num_nodes=2 must be a multiple of 2 x"),
    ],
)
def test_pipeline_options_that_cannot_run_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], overrides: list[str], field: str
) -> None:
    error = fail_with(["train", "--config", str(RECIPES / "cpu-pp-debug.yaml"), *overrides], capsys)
    assert field in error
