"""The language model's own part of pipeline parallel: GPT and Llama cut into stages, the FLOPs MFU counts under a
pipeline, a LoRA recipe refused under one, and Llama trained through one.

The machinery's pipeline (schedules, meshes, resuming, the job's lifecycle) is tests/unit/test_pipeline_stages.py
and tests/e2e/test_pipeline*.py, on the toy task; this file checks the language model's code under it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import (
    PIPELINE,
    RECIPES,
    assert_same_losses,
    fail_with,
    read_csv_metrics,
    run_cli,
    train_args,
    train_losses,
)

from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.strategies.pipeline import PipelineRank, build_stages, stage_split
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model

CONFIG = ModelConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_gpt_and_llama_stages_keep_the_whole_models_names_and_weights_and_chain_to_its_output(arch: str) -> None:
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


def test_a_gpt_stage_built_on_the_meta_device_holds_its_blocks_and_the_last_stage_the_norm_and_head() -> None:
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


def test_lora_is_refused_under_a_pipeline_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    error = fail_with(["train", "--config", str(RECIPES / "cpu-pp-debug.yaml"), "--lora.rank", "4"], capsys)
    assert "lora.rank=4 does not run under pipeline parallel" in error


LLAMA = ["--model.arch", "llama", "--model.bias", "false", "--model.n_head", "4", "--model.n_kv_head", "2"]
LLAMA += ["--model.intermediate_size", "96"]
STEPS = 8
SHARED = [
    "--train.max_steps", str(STEPS), "--eval.every_steps", "4", "--checkpoint.save_every_steps", "4",
    "--checkpoint.resume", "null", *LLAMA,
]  # fmt: skip


def validation_losses(out_dir: Path) -> dict[int, float]:
    """step -> logged validation loss."""
    return {int(row["step"]): float(row["val/loss"]) for row in read_csv_metrics(out_dir) if row.get("val/loss")}


@pytest.mark.slow
@pytest.mark.matrix
def test_llama_trains_and_validates_through_a_pipeline_as_under_ddp(tmp_path: Path) -> None:
    """Same seed, same global batch of 8 sequences: ddp (2 processes x 4) and a 2-stage 1F1B pipeline (1
    data-parallel rank x 8, in 4 pieces) give the same training and validation losses."""
    runs = {}
    for name, overrides in (("ddp", ["--strategy.name", "ddp"]), ("pipeline", PIPELINE)):
        runs[name] = tmp_path / name
        result = run_cli(*train_args(runs[name], *SHARED, *overrides))
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(train_losses(runs["pipeline"]), train_losses(runs["ddp"]), tolerance=1e-5)
    assert_same_losses(validation_losses(runs["pipeline"]), validation_losses(runs["ddp"]), tolerance=1e-5)


@pytest.mark.slow
def test_under_bf16_mixed_a_pipeline_computes_its_loss_in_fp32_as_the_unsplit_model_does(tmp_path: Path) -> None:
    """cpu-pp-debug in bf16-mixed (16-bit stages under fully_shard): 2 stages on 2 processes against the model on 1
    process without a pipeline, the same batches. The last stage hands its logits to the loss in fp32, as Fabric hands
    a model's outputs without a pipeline: the first step's loss (the same weights) agrees within 1e-5, the next within
    1e-3. Given the bf16 logits, the loss was bf16 on the last stage, and the step's all-reduce of it against the
    other stages' fp32 zero failed (gloo: "4 vs 2" bytes)."""
    shared = [
        "train", "--config", str(RECIPES / "cpu-pp-debug.yaml"), "--precision", "bf16-mixed", "--logger.name", "csv",
        "--train.max_steps", "3", "--eval.every_steps", "0", "--logger.log_every_steps", "1",
        "--checkpoint.save_every_steps", "0",
    ]  # fmt: skip
    layouts = {
        "pipeline": ["--devices", "2"],
        "whole": ["--devices", "1", "--strategy.fsdp2.pipeline_parallel_size", "1"],
    }
    runs = {name: tmp_path / name for name in layouts}
    for name, out_dir in runs.items():
        result = run_cli(*shared, "--out_dir", str(out_dir), *layouts[name])
        assert result.returncode == 0, result.stderr[-3000:]
    split, whole = train_losses(runs["pipeline"]), train_losses(runs["whole"])
    assert split.keys() == whole.keys() == {1, 2, 3}
    assert abs(split[1] - whole[1]) < 1e-5, (split, whole)
    assert_same_losses(split, whole, tolerance=1e-3)
