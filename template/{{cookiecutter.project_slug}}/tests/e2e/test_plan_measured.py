"""`plan` for a task without size formulas (no `Task.model_cost`): the toy task of tests/toy_task/ as a user's task
with its sizing taken out. plan builds its model on the meta device, rehearses one step of the recipe on one rank
without sharding, weighs the data-parallel candidates from that (planner/measured.py), and `--write` writes a recipe
of that task, rehearsed, which `train` runs. The machinery's own test: it runs in every project.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import PROJECT, TOY_RECIPE, TOY_TASK, plan_json, run_cli, train_losses, with_task_package

from {{ cookiecutter.package_name }}.planner.plan import CANDIDATES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("toy_task_here")]

# The toy task without what plan reads: no model_cost (sizing.py is left out) and no flops_per_unit, which reads it.
FORMULA_LESS_TASK = '''"""The toy task without size formulas."""

from . import with_formulas


class VectorRegression(with_formulas.VectorRegression):
    def model_cost(self) -> None:
        return None

    def flops_per_unit(self) -> None:
        return None
'''
RUN = ["--train.max_steps", "2", "--eval.batches", "2", "--logger.name", "csv", "--logger.log_every_steps", "1"]


@pytest.fixture(scope="module")
def formula_less_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's src/ with the toy task added as a package without size formulas."""
    folder = tmp_path_factory.mktemp("formula-less-task")
    for module in (PROJECT / "tests" / "toy_task").glob("*.py"):
        if module.name != "sizing.py":
            shutil.copy(module, folder / ("with_formulas.py" if module.name == "task.py" else module.name))
    (folder / "task.py").write_text(FORMULA_LESS_TASK)
    return with_task_package(folder, TOY_TASK, tmp_path_factory.mktemp("formula-less") / "src")


def test_a_task_without_size_formulas_is_planned_from_a_rehearsal_and_its_written_recipe_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], formula_less_source: Path
) -> None:
    # The toy task's formulas (in this process) size a device between fsdp2's total and ddp's: sharding is needed.
    formulas = {option["strategy"]: option for option in plan_json(capsys, str(TOY_RECIPE), "--margin", "0")["options"]}
    memory = (formulas["fsdp2"]["total_bytes"] + formulas["ddp"]["total_bytes"]) / 2
    target = tmp_path / "planned.yaml"
    device = ["--margin", "0", "--gpu_memory_gib", f"{memory / 2**30:.12f}"]
    result = run_cli(
        "plan", str(TOY_RECIPE), "--data.samples", "256", *device, "--json", "--write", str(target),
        source=formula_less_source,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["sizes_from"] == "rehearsal" and plan["model"].startswith("no size formulas: 3 blocks")
    measured = {option["strategy"]: option for option in plan["options"]}
    # Only the data-parallel candidates: one rank without sharding shows neither tensor nor pipeline splits.
    assert list(measured) == [c.name for c in CANDIDATES if c.option.layout() == (1, 1)]
    for name, option in measured.items():
        # The meta build's parameters, and each block's, give every candidate the formulas' model states and runtime.
        for key in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "runtime_extra_bytes"):
            assert option[key] == pytest.approx(formulas[name][key]), (name, key)
        # What the rehearsed step held beyond the model states stands in for the formulas' activations.
        assert 0.5 < option["activation_bytes"] / formulas[name]["activation_bytes"] < 2, name
    assert not measured["ddp"]["fits"] and measured["fsdp2"]["fits"]
    assert plan["recommended"]["strategy"] == "fsdp2"
    assert f"wrote {target} (rehearsed ranks 0, 1: peak " in result.stderr
    written, toy = yaml.safe_load(target.read_text()), yaml.safe_load(TOY_RECIPE.read_text())
    assert written["task"] == TOY_TASK and written["strategy"]["name"] == "fsdp2"
    assert toy["model"].items() <= written["model"].items() and toy["train"].items() <= written["train"].items()
    assert written["data"]["samples"] == 256  # the override on plan's command line, kept
    trained = run_cli("train", "--config", str(target), "--out_dir", str(tmp_path / "run"), *RUN, source=formula_less_source)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]
