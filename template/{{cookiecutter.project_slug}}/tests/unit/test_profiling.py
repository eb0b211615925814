"""Profiling runs only in the steps a recipe names, and the slowest rank is named only past the margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, fail_with
from lightning.fabric import Fabric

from {{ cookiecutter.package_name }}.recipe.schema import ProfileConfig, Recipe
from {{ cookiecutter.package_name }}.training.loggers import build_loggers, finish_loggers
from {{ cookiecutter.package_name }}.training.profiling import StepProfiler, step_ranges
from {{ cookiecutter.package_name }}.training.stragglers import straggler_figures


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (["--profile.steps", "[0]"], "profile.steps"),
        (["--train.max_steps", "10", "--profile.steps", "[11]"], "profile.steps"),
        (["--profile.steps", f"[{', '.join(map(str, range(1, 102)))}]"], "profile.steps"),
        (["--profile.ranks", "[2]"], "profile.ranks"),  # cpu-debug runs 2 processes
        (["--logger.straggler_margin", "-0.1"], "logger.straggler_margin"),
    ],
)
def test_bad_profile_and_straggler_settings_are_refused_in_one_line(
    override: list[str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = fail_with(
        ["train", "--config", str(RECIPES / "cpu-debug.yaml"), *override, "--out_dir", str(tmp_path / "r")], capsys
    )
    assert f"{field}=" in err and not (tmp_path / "r").exists()


def test_consecutive_profiled_steps_share_one_trace() -> None:
    assert step_ranges([9, 3, 4, 5, 4]) == [(3, 5), (9, 9)]
    assert step_ranges([]) == []


def test_the_profiler_records_only_the_named_steps_and_writes_a_chrome_trace(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    recipe = Recipe(accelerator="cpu", out_dir=str(tmp_path), profile=ProfileConfig(steps=[2, 3], ranks=[0]))
    profiler = StepProfiler(fabric, recipe)
    active = {}
    weights = torch.randn(32, 32)
    for step in range(1, 5):
        profiler.step_begins(step)
        active[step] = torch.autograd._profiler_enabled()
        (weights @ weights).sum()
        profiler.step_ends(step)
    assert active == {1: False, 2: True, 3: True, 4: False}  # nothing runs outside the named steps
    trace = json.loads((tmp_path / "profile" / "steps-2-3" / "rank0.pt.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"step 2", "step 3", "aten::mm"} <= names and "step 1" not in names and "step 4" not in names
    assert any(event.get("name") == "[memory]" for event in trace["traceEvents"])  # profile.memory: the memory view


def test_with_wandb_the_traces_are_saved_with_the_runs_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = Recipe(out_dir=str(tmp_path), profile=ProfileConfig(steps=[1]))
    recipe.logger.name = "wandb"
    loggers = build_loggers(recipe, run_id="abcd1234")
    profiler = StepProfiler(Fabric(accelerator="cpu", devices=1, loggers=loggers), recipe)
    profiler.step_begins(1)
    torch.randn(8, 8).sum()
    profiler.step_ends(1)
    profiler.log_traces(loggers)
    finish_loggers(loggers)
    [run] = (tmp_path / "wandb").glob("offline-run-*-abcd1234")
    assert (run / "files" / "profile" / "steps-1-1" / "rank0.pt.trace.json").is_file()


def test_a_rank_not_named_in_profile_ranks_records_nothing(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)  # rank 0
    profiler = StepProfiler(fabric, Recipe(out_dir=str(tmp_path), profile=ProfileConfig(steps=[1], ranks=[1])))
    profiler.step_begins(1)
    assert not torch.autograd._profiler_enabled()
    profiler.step_ends(1)
    assert not (tmp_path / "profile").exists()


def test_the_rank_slower_than_the_median_by_more_than_the_margin_is_named() -> None:
    metrics, line = straggler_figures([0.30, 0.31, 0.29, 0.45], [0.0, 0.0, 0.0, 0.0], margin=0.2)
    assert line is not None and line.startswith("straggler: rank 3 takes 0.450 s per step")
    assert metrics["stragglers/straggler_rank"] == 3 and metrics["stragglers/slowest_rank"] == 3
    assert metrics["stragglers/median_step_seconds"] == pytest.approx(0.305)


def test_a_rank_waiting_for_its_data_is_named_by_its_data_wait() -> None:
    metrics, line = straggler_figures([0.30, 0.30, 0.30], [0.01, 0.20, 0.01], margin=0.2)
    assert line is not None and "rank 1 waits 0.200 s per step for data" in line
    assert metrics["stragglers/straggler_rank"] == 1 and metrics["stragglers/slowest_data_wait_rank"] == 1


def test_ranks_within_the_margin_name_no_straggler() -> None:
    metrics, line = straggler_figures([0.30, 0.33, 0.29], [0.01, 0.02, 0.01], margin=0.2)
    assert line is None and metrics["stragglers/straggler_rank"] == -1
    assert straggler_figures([0.5], [0.4], margin=0.2)[1] is None  # one rank: nobody to be slower than
