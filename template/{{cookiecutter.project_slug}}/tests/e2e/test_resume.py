"""A job killed at any point and resumed with `resume: auto` ends bitwise identical to one never interrupted: its
losses, its final weights, its per-step fingerprints (logger.fingerprint) and its last checkpoint, entry by entry.

The machinery's own test: it trains the toy task (tests/toy_task/), so it runs in every project, whatever its task.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from helpers import final_weights, losses_by_run, read_csv_metrics, run_cli, toy_train_args

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.training.fingerprint import read_fingerprints
from {{ cookiecutter.package_name }}.training.goodput import LAUNCHED, PHASES, REDONE, STARTUP, phase_key

pytestmark = pytest.mark.slow
MAX_STEPS = 24
# 118 vectors -> 104 for training (one in 8 held out); 8 per step over 2 ranks: epoch 1 starts in step 14.
SAMPLES = 118


def overrides(strategy: str) -> list[str]:
    """This file's runs: a strategy on the toy task's vectors, resumed automatically."""
    return [
        "--strategy.name", strategy, "--data.samples", str(SAMPLES), "--eval.batches", "1",
        "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", "8", "--eval.every_steps", "6",
        "--checkpoint.resume", "auto", "--logger.fingerprint", "true",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> dict[str, tuple[dict, dict, Path]]:
    """One uninterrupted run per strategy: (losses by step, final weights, its out_dir)."""
    results = {}
    for strategy in ("ddp", "fsdp2"):
        out_dir = tmp_path_factory.mktemp(f"reference-{strategy}")
        result = run_cli(*toy_train_args(out_dir, *overrides(strategy)), source=toy_source)
        assert result.returncode == 0, result.stderr[-3000:]
        (losses,) = losses_by_run(out_dir)
        assert sorted(losses) == list(range(1, MAX_STEPS + 1))
        epochs = {int(r["step"]): float(r["train/epoch"]) for r in read_csv_metrics(out_dir) if r.get("train/epoch")}
        assert epochs[8] == epochs[12] == 0 and epochs[13] == 1  # the first pass ends with step 13
        _, fingerprints, restarts = read_fingerprints(out_dir)
        assert sorted(fingerprints) == list(range(1, MAX_STEPS + 1)) and not restarts
        results[strategy] = (losses, final_weights(out_dir, MAX_STEPS), out_dir)
    return results


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.matrix), "fsdp2"])
@pytest.mark.parametrize(
    ("fault", "resumes_at"),
    [
        ("kill-at-step:3", None),  # early: no checkpoint yet, the rerun starts over
        ("kill-at-step:8", 8),  # just after a save
        pytest.param("kill-at-step:11", 8, marks=pytest.mark.matrix),  # mid-epoch (step 15 resumes mid-epoch too)
        ("kill-at-step:15", 8),  # the data crossed an epoch boundary after the checkpoint
        ("kill-in-save:16", 8),  # while writing a checkpoint: the previous one is used
    ],
)
def test_killed_and_resumed_run_is_bitwise_identical(
    tmp_path: Path,
    toy_source: Path,
    reference: dict,
    strategy: str,
    fault: str,
    resumes_at: int | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected_losses, expected_weights, reference_dir = reference[strategy]
    killed = run_cli(*toy_train_args(tmp_path, *overrides(strategy)), fault=fault, source=toy_source)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if fault.startswith("kill-in-save"):
        assert (tmp_path / "checkpoints" / "step-00000016.partial").is_dir()

    resumed = run_cli(*toy_train_args(tmp_path, *overrides(strategy)), source=toy_source)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if resumes_at is None:
        assert "starting from step 0" in resumed.stdout
    else:
        assert f"step-{resumes_at:08d} at step {resumes_at}" in resumed.stdout
        if fault.startswith("kill-in-save"):
            assert "skipping unfinished checkpoint" in resumed.stderr

    before_kill, after_resume = losses_by_run(tmp_path)
    kill_step = int(fault.split(":")[1])
    assert max(before_kill) == kill_step
    assert before_kill == {step: expected_losses[step] for step in before_kill}  # bitwise: floats compared exactly
    first = (resumes_at or 0) + 1
    assert after_resume == {step: expected_losses[step] for step in range(first, MAX_STEPS + 1)}
    weights = final_weights(tmp_path, MAX_STEPS)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
    assert_startup_logged(tmp_path, redone=kill_step - (resumes_at or 0), resumed=resumes_at is not None)

    # Every step's loss, gradient norm and parameter hash, as the resumed run last wrote it, is the reference's.
    _, fingerprints, restarts = read_fingerprints(tmp_path)
    assert restarts == [resumes_at or 0]
    assert fingerprints == read_fingerprints(reference_dir)[1]
    main(["checkpoint", "compare", "--fingerprints", str(tmp_path), str(reference_dir)])  # exit 0: no SystemExit
    main(["checkpoint", "compare", str(tmp_path), str(reference_dir)])  # the last checkpoints, entry by entry
    out = capsys.readouterr().out
    assert f"agree at all {MAX_STEPS} steps both recorded" in out and ", 0 differ" in out


def assert_startup_logged(out_dir: Path, redone: int, resumed: bool) -> None:
    """Each lifetime logged its start-up once, in phases that sum to it; the restart the steps it redid."""
    first, restart = [row for row in read_csv_metrics(out_dir) if row.get(STARTUP)]
    for row in (first, restart):
        phases = {phase: float(row[phase_key(phase)]) for phase in PHASES}
        assert all(seconds >= 0 for seconds in phases.values()) and phases["imports"] > 0
        assert sum(phases.values()) == pytest.approx(float(row[STARTUP]))
    assert float(first[REDONE]) == 0 and float(restart[REDONE]) == redone
    assert (float(restart[phase_key("checkpoint_load")]) > 0) == resumed
    assert float(restart[LAUNCHED]) > float(first[LAUNCHED])


# CI: the kill while a background save may be in flight; the kill inside the save repeats the synchronous case's.
@pytest.mark.parametrize("fault", [pytest.param("kill-in-save:16", marks=pytest.mark.matrix), "kill-at-step:19"])
def test_async_save_resumes_bitwise_identical_to_the_synchronous_run(
    tmp_path: Path, toy_source: Path, reference: dict, fault: str
) -> None:
    expected_losses, expected_weights, _ = reference["fsdp2"]
    asynchronous = [*overrides("fsdp2"), "--checkpoint.async_save", "true"]
    killed = run_cli(*toy_train_args(tmp_path, *asynchronous), fault=fault, source=toy_source)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*toy_train_args(tmp_path, *asynchronous), source=toy_source)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # A background save becomes visible once written: by the kill at 19 the one of step 16 normally is.
    match = re.search(r"Resumed from \S+ at step (\d+)", resumed.stdout)
    assert match, resumed.stdout[-2000:]
    resumes_at = int(match.group(1))
    assert resumes_at == 8 if fault.startswith("kill-in-save") else resumes_at in (8, 16)
    _, after_resume = losses_by_run(tmp_path)
    assert after_resume == {step: expected_losses[step] for step in range(resumes_at + 1, MAX_STEPS + 1)}
    weights = final_weights(tmp_path, MAX_STEPS)
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
