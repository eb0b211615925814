"""The recipe `plan --write` writes is a recipe like any other: `recipes validate` accepts it and `train` runs it.

On the toy task's recipe (tests/toy-debug.yaml: 2 CPU processes): the recommended ddp, and a sharded candidate
(fsdp2) chosen because the memory per process, set with --gpu_memory_gib, holds its sharded states but not ddp's
whole ones. The machinery's own test: it plans and trains the toy task, so it runs in every project.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import TOY_RECIPE, run_cli, train_losses

from {{ cookiecutter.package_name }}.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("toy_task_here")]

RUN = ["--train.max_steps", "2", "--eval.batches", "2", "--logger.name", "csv", "--logger.log_every_steps", "1"]


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    main(["plan", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def write_plan(capsys: pytest.CaptureFixture[str], target: Path, *args: str) -> dict:
    """Write the recommended recipe of `plan ARGS` to target; return it as loaded from YAML."""
    main(["plan", *args, "--write", str(target)])
    assert f"wrote {target}" in capsys.readouterr().out
    return yaml.safe_load(target.read_text())


def assert_validates_and_trains(recipe: Path, out_dir: Path, source: Path) -> None:
    validated = run_cli("recipes", "validate", str(recipe), source=source)
    assert validated.returncode == 0 and validated.stdout.startswith(f"ok: {recipe}"), validated.stderr[-2000:]
    trained = run_cli("train", "--config", str(recipe), "--out_dir", str(out_dir), *RUN, source=source)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(train_losses(out_dir)) == [1, 2]


def test_a_written_ddp_recipe_validates_and_trains_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toy_source: Path
) -> None:
    target = tmp_path / "planned-ddp.yaml"
    recipe = write_plan(capsys, target, str(TOY_RECIPE))
    assert recipe["strategy"]["name"] == "ddp" and recipe["strategy"]["activation_checkpointing"] is False
    assert (recipe["accelerator"], recipe["devices"], recipe["model"]["width"]) == ("cpu", 2, 32)
    assert_validates_and_trains(target, tmp_path / "run", toy_source)


def test_a_written_sharded_recipe_validates_and_trains_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toy_source: Path
) -> None:
    options = {option["strategy"]: option for option in plan_json(capsys, str(TOY_RECIPE))["options"]}
    held = {
        name: option["model_state_bytes"] + option["runtime_extra_bytes"]
        + option["activation_bytes_without_checkpointing"]
        for name, option in options.items()
    }  # fmt: skip
    assert held["fsdp2"] < held["ddp"]
    # Memory per process for fsdp2 without checkpointing (and the 10% margin), not for ddp's whole states.
    memory_gib = held["fsdp2"] * 1.01 / 0.9 / 2**30
    target = tmp_path / "planned-fsdp2.yaml"
    recipe = write_plan(capsys, target, str(TOY_RECIPE), "--gpu_memory_gib", f"{memory_gib:.9f}")
    assert recipe["strategy"]["name"] == "fsdp2"
    assert recipe["strategy"]["fsdp2"] == {"tensor_parallel_size": 1, "float8": False}
    assert recipe["strategy"]["process_group_backend"] == "gloo"
    assert_validates_and_trains(target, tmp_path / "run", toy_source)
