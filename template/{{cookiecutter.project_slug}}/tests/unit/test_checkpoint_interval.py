"""The checkpoint interval that maximises goodput (planner/interval.py): its arithmetic, `plan --mtbf` and its
refusals, and the recipe's `checkpoint.save_every_minutes: auto` (saving by it is run in
tests/e2e/test_checkpoint_cli.py).

The machinery's own test: it plans the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml
from helpers import TOY_RECIPE, fail_with, plan_json

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.planner.interval import (
    SaveCost,
    checkpoint_bytes_per_rank,
    expected_goodput,
    interval_plan,
    parse_duration,
    young_interval,
)
from {{ cookiecutter.package_name }}.planner.options import PlanSizes
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

# The toy task's recipe on a node of 8 GPUs in bf16-mixed, its MLP 21.5 B parameters: sharded by plan.
ON_GPUS = [str(TOY_RECIPE), "--accelerator", "cuda", "--devices", "8", "--precision", "bf16-mixed"]
ON_GPUS += ["--strategy.process_group_backend", "nccl", "--model.width", "8192", "--model.depth", "80"]
EIGHT_HOURS = 8 * 3600


def test_youngs_interval_of_a_60_second_save_and_an_8_hour_mtbf_is_1859_seconds() -> None:
    assert round(young_interval(60, EIGHT_HOURS)) == 1859


def test_goodput_counts_the_saves_the_restart_and_half_an_interval_redone() -> None:
    # 1859 / (1859 + 60) of the time trains; each failure, every 8 h, costs 300 s and (1859 + 60) / 2 s redone.
    interval = young_interval(60, EIGHT_HOURS)
    goodput = expected_goodput(interval, 60, EIGHT_HOURS, restart_seconds=300)
    assert goodput == pytest.approx(interval / (interval + 60) * (1 - (300 + (interval + 60) / 2) / EIGHT_HOURS))
    assert round(100 * goodput, 1) == 92.6
    # Young's interval is where the goodput peaks: saving twice as often, or half as often, keeps less.
    assert goodput > expected_goodput(interval / 2, 60, EIGHT_HOURS, 300)
    assert goodput > expected_goodput(interval * 2, 60, EIGHT_HOURS, 300)


def test_a_background_save_is_weighed_by_its_blocking_part_and_spaced_at_least_by_its_write() -> None:
    quick_copy = interval_plan(SaveCost(blocking_seconds=2, write_seconds=60, source="a"), EIGHT_HOURS, 300)
    assert quick_copy.interval_seconds == pytest.approx(math.sqrt(2 * 2 * EIGHT_HOURS))  # 339 s: beyond the write
    slow_write = interval_plan(SaveCost(blocking_seconds=0.1, write_seconds=600, source="a"), EIGHT_HOURS, 300)
    assert slow_write.interval_seconds == 600  # sqrt(2 x 0.1 x 8 h) = 76 s: the next save would wait for the write


def test_a_rank_writes_the_fp32_weights_and_moments_its_zero_stage_leaves_it() -> None:
    sizes = PlanSizes(parameters=1e9, layer=0, root=0, precision="bf16-mixed", data_parallel=8)
    assert checkpoint_bytes_per_rank(sizes, stage=0) == 12e9  # ddp: one rank writes the whole state
    assert checkpoint_bytes_per_rank(sizes, stage=1) == 4e9 + 8e9 / 8  # the moments sharded
    assert checkpoint_bytes_per_rank(sizes, stage=3) == 12e9 / 8  # everything sharded


@pytest.mark.parametrize(("text", "seconds"), [("8h", 28800), ("90m", 5400), ("3600s", 3600), ("1.5d", 129600)])
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text, "--mtbf") == seconds


@pytest.mark.parametrize("text", ["8", "8x", "0h", "-1h", "h", "", "infh"])
def test_a_duration_without_a_unit_or_above_zero_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(RecipeError, match=r"^--mtbf='.*': expected a duration > 0 such as 8h, 90m or 3600s"):
        parse_duration(text, "--mtbf")


@pytest.mark.usefixtures("toy_task_here")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mtbf", "8 hours"], "--mtbf='8 hours': expected a duration > 0 such as 8h, 90m or 3600s"),
        (["--mtbf", "8h", "--restart", "soon"], "--restart='soon': expected a duration"),
        (["--restart", "5m"], "--restart needs --mtbf"),
        (["--from_run", "runs/x"], "--from_run needs --mtbf"),
        (["--mtbf", "8h", "--write_gb_s", "0"], "--write_gb_s=0 must be > 0"),
        (["--mtbf", "8h", "--from_run", "/no/such/run"], "--from_run /no/such/run: '/no/such/run' is not a folder"),
    ],
)
def test_plan_refuses_a_bad_interval_option_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in fail_with(["plan", *ON_GPUS, *args], capsys)


def run_that_saved(out_dir: Path, seconds: list[float]) -> Path:
    """A run's CSV metrics as training/monitor.py logs them: a training row per step, a row per save."""
    folder = out_dir / "csv" / "version_0"
    folder.mkdir(parents=True)
    with (folder / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["step", "train/loss", "time/checkpoint_save_seconds"])
        writer.writeheader()
        for step, save in enumerate(seconds, start=1):
            writer.writerows([{"step": step, "train/loss": 1.0}, {"step": step, "time/checkpoint_save_seconds": save}])
    return out_dir


@pytest.mark.usefixtures("toy_task_here")
def test_plan_prints_the_interval_and_goodput_from_a_runs_measured_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_that_saved(tmp_path / "run", [50.0, 60.0, 75.0])
    main(["plan", *ON_GPUS, "--mtbf", "8h", "--from_run", str(run)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == (
        "Checkpoint interval: save every 31.0 min (checkpoint.save_every_minutes: 31.0); expected goodput 92.6%"
        " with an MTBF of 8.0 h and a restart of 5.0 min"
    )
    assert lines[-1].startswith(f"  from a save that blocks training 60 s (measured: the median of 3 saves of {run})")


@pytest.mark.usefixtures("toy_task_here")
def test_without_a_run_the_save_is_estimated_from_the_bytes_per_rank_at_the_stated_bandwidth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    planned = plan_json(capsys, *ON_GPUS, "--mtbf", "90m", "--write_gb_s", "2", "--restart", "600s")
    interval = planned["checkpoint_interval"]
    assert "per rank at 2 GB/s (--write_gb_s)" in interval["save_cost_from"]
    save = interval["save_blocking_seconds"]
    assert interval["interval_seconds"] == pytest.approx(math.sqrt(2 * save * 5400))
    assert interval["restart_seconds"] == 600 and interval["mtbf_seconds"] == 5400
    assert interval["expected_goodput"] == pytest.approx(
        expected_goodput(interval["interval_seconds"], save, 5400, 600)
    )


@pytest.mark.usefixtures("toy_task_here")
def test_plan_write_puts_the_interval_in_the_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "mine.yaml"
    run = run_that_saved(tmp_path / "run", [60.0])
    # On 24 GB cards the plan offloads to DeepSpeed, whose rehearsal is not run on CPUs: quick to write.
    main(["plan", *ON_GPUS, "--gpu", "RTX-4090", "--mtbf", "8h", "--from_run", str(run), "--write", str(target)])
    assert f"wrote {target}" in capsys.readouterr().out
    assert yaml.safe_load(target.read_text())["checkpoint"]["save_every_minutes"] == 30.98  # 1859 s


@pytest.mark.usefixtures("toy_task_here")
def test_auto_saving_needs_an_mtbf_and_takes_no_other_word() -> None:
    auto = ["--config", str(TOY_RECIPE), "--checkpoint.save_every_minutes", "auto"]
    with pytest.raises(RecipeError, match=r"checkpoint.save_every_minutes=auto needs checkpoint.mtbf_hours"):
        parse_recipe(auto, "train")
    assert parse_recipe([*auto, "--checkpoint.mtbf_hours", "8"], "train").checkpoint.save_every_minutes == "auto"
    with pytest.raises(
        RecipeError, match=r"checkpoint.save_every_minutes: expected float or one of 'auto', got 'often'"
    ):
        parse_recipe(["--config", str(TOY_RECIPE), "--checkpoint.save_every_minutes", "often"], "train")
