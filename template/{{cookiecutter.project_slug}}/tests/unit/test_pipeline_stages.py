"""Pipeline stages: where the blocks are split, what each stage builds, and the pipeline options a recipe may ask.

The machinery's own test: its stages are cut from the toy task's MLP (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import PIPELINE, TOY_RECIPE, fail_with
from toy_task.model import Mlp
from toy_task.task import MlpConfig

from {{ cookiecutter.package_name }}.strategies.pipeline import PipelineRank, balanced_split, build_stages, stage_boundaries

CONFIG = MlpConfig(width=16, depth=4)


def test_a_balanced_split_weighs_the_layers_before_and_after_the_blocks() -> None:
    assert balanced_split([10, 10, 10, 10], first=0, last=0, stages=2) == [2, 2]
    assert balanced_split([10, 10, 10, 10], first=25, last=5, stages=2) == [1, 3]  # 35 and 35 parameters
    assert balanced_split([10, 10, 10, 10], first=0, last=0, stages=4) == [1, 1, 1, 1]


def test_stages_keep_the_whole_models_names_and_weights_and_chain_to_its_output() -> None:
    torch.manual_seed(0)
    whole = Mlp(CONFIG)
    torch.manual_seed(0)
    first, last = build_stages(partial(Mlp, CONFIG), [1, 3], [0, 1], on_meta=False)
    assert [name for name, _ in first.named_parameters()][-1].startswith("blocks.0.")
    assert next(name for name, _ in last.named_parameters()).startswith("blocks.1.")
    together = PipelineRank([first, last]).state_dict()
    assert together.keys() == whole.state_dict().keys()
    assert all(torch.equal(together[name], value) for name, value in whole.state_dict().items())
    vectors = torch.randn(2, CONFIG.inputs)
    torch.testing.assert_close(last(first(vectors)), whole(vectors))


def test_a_stage_built_on_the_meta_device_holds_only_its_own_blocks() -> None:
    (stage,) = build_stages(partial(Mlp, CONFIG), [2, 2], [1], on_meta=True)
    assert {name.split(".")[0] for name, _ in stage.named_parameters()} == {"blocks", "head"}
    assert stage.blocks.indices() == [2, 3] and all(p.is_meta for p in stage.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_boundaries_are_what_the_stages_run_one_after_another_take_and_give(dtype: torch.dtype) -> None:
    """The shapes a rehearsal gives each stage (no peer to ask) are those of the stages' own outputs, in the dtype they
    compute in; the first stage takes the inputs as they come."""
    split, vectors = [1, 2, 1], torch.randn(3, CONFIG.inputs)
    boundaries = stage_boundaries(partial(Mlp, CONFIG), split, (vectors,), dtype)
    stages = [stage.to(dtype) for stage in build_stages(partial(Mlp, CONFIG), split, [0, 1, 2], on_meta=False)]
    flowing = vectors
    for index, (stage, (inputs, outputs)) in enumerate(zip(stages, boundaries, strict=True)):
        (taken,) = inputs
        assert (taken.shape, taken.dtype, taken.requires_grad) == (flowing.shape, flowing.dtype, index > 0)
        flowing = stage(flowing.to(dtype))
        (given,) = outputs
        assert (given.shape, given.dtype, given.is_meta) == (flowing.shape, dtype, True)


ZERO_BUBBLE_IN_5_PIECES = [
    "--strategy.fsdp2.pipeline_schedule", "InterleavedZeroBubble", "--train.micro_batch_size", "10",
    "--strategy.fsdp2.pipeline_microbatches", "5",
]  # fmt: skip
IN_2_ROUNDS = "in 2 rounds of pipeline_parallel_size=2, which must divide them (choose from [1, 2, 10])"


@pytest.mark.usefixtures("toy_task_here")
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--strategy.fsdp2.pipeline_microbatches", "3"], "pipeline_microbatches=3 must divide"),
        (["--strategy.fsdp2.pipeline_microbatches", "1"], "pipeline_schedule=1F1B feeds at least pipeline_parallel"),
        (["--strategy.fsdp2.pipeline_split", "[1,1]"], "pipeline_split=[1, 1] must give each of the 2 stages"),
        (["--strategy.fsdp2.pipeline_schedule", "Interleaved1F1B"], "pipeline_stages_per_rank=1"),
        (["--strategy.fsdp2.pipeline_schedule", "ZBVZeroBubble"], "pipeline_schedule=ZBVZeroBubble holds 2 per rank"),
        (ZERO_BUBBLE_IN_5_PIECES, IN_2_ROUNDS),
        (["--strategy.fsdp2.pipeline_parallel_size", "3"], "pipeline_parallel_size=3 x tensor_parallel_size=1"),
        (["--strategy.name", "hsdp", "--num_nodes", "2", "--devices", "1"], "num_nodes=2 must be a multiple of 2 x"),
    ],
)
def test_pipeline_options_that_cannot_run_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], overrides: list[str], field: str
) -> None:
    error = fail_with(["train", "--config", str(TOY_RECIPE), *PIPELINE, *overrides], capsys)
    assert field in error
