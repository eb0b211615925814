"""`plan --write` rehearses the recipe it writes, rank by rank as `rehearse` does, and writes nothing when a rank would
run out of memory.

On the toy task's recipe (tests/toy-debug.yaml: 2 CPU processes): the recommended ddp, and a layout whose rehearsal
peaks above the memory per process. test_plan_measured.py trains a written recipe (of the toy task without size
formulas). The machinery's own test: it plans the toy task, so it runs in every project.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TOY_RECIPE, assert_one_line_refusal, plan_json, run_cli

from {{ cookiecutter.package_name }}.recipe.load import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("toy_task_here")]


def test_a_written_ddp_recipe_is_rehearsed_and_loads(tmp_path: Path, toy_source: Path) -> None:
    """Both ranks of the written recipe built and stepped before it is written; the recipe checks pass."""
    target = tmp_path / "planned-ddp.yaml"
    result = run_cli("plan", str(TOY_RECIPE), "--write", str(target), source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote {target} (rehearsed ranks 0, 1: peak " in result.stdout
    recipe = load_recipe(target)
    assert recipe.strategy.name == "ddp" and recipe.strategy.activation_checkpointing is False
    assert (recipe.accelerator, recipe.devices, recipe.model.width) == ("cpu", 2, 32)


def test_a_layout_whose_rehearsal_peaks_above_the_memory_is_not_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toy_source: Path
) -> None:
    """With 4 micro-batches a step, fully_shard keeps each block's whole gradient between them, which plan's fsdp2
    estimate leaves out: memory 5% above that estimate (and below ddp's) fits it by plan, not by its rehearsal."""
    layout = [str(TOY_RECIPE), "--train.grad_accum_steps", "4", "--margin", "0"]
    options = {option["strategy"]: option for option in plan_json(capsys, *layout)["options"]}
    memory = options["fsdp2"]["total_bytes"] * 1.05
    assert memory < options["ddp"]["total_bytes"]
    target = tmp_path / "planned.yaml"
    result = run_cli("plan", *layout, "--gpu_memory_gib", f"{memory / 2**30:.12f}", "--write", str(target), source=toy_source)  # fmt: skip
    assert "recommended: fsdp2: " in result.stdout
    assert_one_line_refusal(result.returncode, result.stderr, f"--write {target}: not written: rehearsed, rank ")
    assert "peaks at" in result.stderr and "above the CPU" in result.stderr
    assert not target.exists()
