"""Checkpoint schedule and retention, skipping of damaged checkpoints, and the checkpoint commands.

The machinery's own test: it trains the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import read_csv_metrics, run_cli, toy_train_args
from toy_task.model import Mlp
from toy_task.task import MlpConfig

from {{ cookiecutter.package_name }}.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> Path:
    """12 steps saving by wall time (every few milliseconds), keeping the newest 2 checkpoints."""
    out_dir = tmp_path_factory.mktemp("timed")
    schedule = ["--checkpoint.save_every_steps", "0", "--checkpoint.save_every_minutes", "0.0001"]
    steps = ["--eval.every_steps", "0", "--train.max_steps", "12", "--checkpoint.keep_last", "2"]
    result = run_cli(*toy_train_args(out_dir, *steps, *schedule), source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Saved checkpoint ") >= 4  # time-based saves, not only the final one
    return out_dir


@pytest.mark.slow
def test_time_based_saves_keep_the_newest_k_and_log_save_time(run_dir: Path) -> None:
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(kept) == 2 and kept[-1] == "step-00000012"
    assert all(
        float(row["time/checkpoint_save_seconds"]) > 0
        for row in read_csv_metrics(run_dir)
        if row.get("time/checkpoint_save_seconds")
    )
    assert any(row.get("time/checkpoint_save_seconds") for row in read_csv_metrics(run_dir))


@pytest.mark.slow
@pytest.mark.usefixtures("toy_task_here")
def test_list_inspect_and_consolidate(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["checkpoint", "list", str(run_dir)])
    listing = capsys.readouterr().out
    assert listing.count("complete") == 2 and "step-00000012" in listing and "MiB" in listing

    newest = run_dir / "checkpoints" / "step-00000012"
    main(["checkpoint", "inspect", str(newest)])
    assert "step         12" in capsys.readouterr().out

    output = tmp_path / "weights.pt"
    main(["checkpoint", "consolidate", str(newest), str(output)])
    config = MlpConfig(**yaml.safe_load((newest / "config.yaml").read_text())["model"])
    model = Mlp(config)
    model.load_state_dict(torch.load(output, weights_only=True))  # strict: every tensor present, nothing extra
    assert model(torch.zeros(1, config.inputs)).shape == (1, config.outputs)


@pytest.mark.slow
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(run_dir: Path, tmp_path: Path, toy_source: Path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    for path in (run_dir / "checkpoints").rglob("*"):
        target = copy / "checkpoints" / path.relative_to(run_dir / "checkpoints")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            target.write_bytes(path.read_bytes())
    older = sorted((copy / "checkpoints").iterdir())[0]
    shard = next((copy / "checkpoints" / "step-00000012" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # as if a node died mid-write after the rename

    listed = run_cli("checkpoint", "list", str(copy))
    assert "step-00000012" in listed.stdout and "INCOMPLETE" in listed.stdout and shard.name in listed.stdout
    steps = ["--eval.every_steps", "0", "--train.max_steps", "14", "--checkpoint.resume", "auto"]
    resumed = run_cli(*toy_train_args(copy, *steps), source=toy_source)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping incomplete checkpoint" in resumed.stderr and "step-00000012" in resumed.stderr
    assert f"Resumed from {older} at step {int(older.name.split('-')[1])}" in resumed.stdout


@pytest.mark.slow
def test_auto_saving_measures_the_first_save_then_saves_every_sqrt_2_c_m(tmp_path: Path, toy_source: Path) -> None:
    """save_every_minutes=auto on 2 processes: a save after step 1, the interval from the slowest rank's cost of it
    (the last rank sleeps 0.2 s a step, so saves fall between steps), then saves by that interval alone."""
    mtbf_hours = 0.0001  # 0.36 s: an interval of a fraction of a second for the toy's quick saves
    schedule = ["--checkpoint.save_every_steps", "0", "--checkpoint.save_every_minutes", "auto"]
    steps = ["--eval.every_steps", "0", "--train.max_steps", "16", "--checkpoint.mtbf_hours", str(mtbf_hours)]
    result = run_cli(*toy_train_args(tmp_path, *steps, *schedule), source=toy_source, fault="slow-rank:1:0.2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Checkpoint interval: every ") == 1, result.stdout

    rows = read_csv_metrics(tmp_path)
    chosen = [row for row in rows if row.get("checkpoint/interval_minutes")]
    assert [int(row["step"]) for row in chosen] == [1]  # chosen once, by the first save
    interval = 60 * float(chosen[0]["checkpoint/interval_minutes"])
    rank0_first_save = float(chosen[0]["time/checkpoint_save_seconds"])
    assert interval >= math.sqrt(2 * rank0_first_save * 3600 * mtbf_hours) * 0.999  # the slowest rank's, at least

    saved = sorted(int(path.name.split("-")[1]) for path in (tmp_path / "checkpoints").iterdir())
    assert saved[0] == 1 and saved[-1] == 16 and len(saved) >= 4  # besides the first and the last: by time
    # A step's row is logged before its save: between two timed saves' rows at least the interval passed.
    logged = {int(row["step"]): float(row["time/unix_time"]) for row in rows if row.get("time/unix_time")}
    between = [logged[later] - logged[earlier] for earlier, later in itertools.pairwise(saved[:-1])]
    assert min(between) >= interval, (saved, between, interval)


def test_commands_refuse_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["consolidate", str(tmp_path / "nope"), str(tmp_path / "w.pt")], ["inspect", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit) as exited:
            main(["checkpoint", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "nope" in err
    assert not (tmp_path / "w.pt").exists()


def complete_checkpoint(root: Path, step: int) -> Path:
    """A folder that checkpoint_layout takes for a complete checkpoint (meta.json with every file's size)."""
    folder = root / f"step-{step:08d}"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "shard").write_bytes(b"x" * 100)
    (folder / "config.yaml").write_text("model: {}\n")
    (folder / "meta.json").write_text(json.dumps({"step": step, "files": {"state/shard": 100, "config.yaml": 10}}))
    return folder


def test_retention_never_leaves_a_half_deleted_folder_under_a_checkpoints_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from {{ cookiecutter.package_name }}.checkpoint.layout import list_checkpoints, remove_old_checkpoints, scan_checkpoints

    for step in (2, 4, 6):
        complete_checkpoint(tmp_path, step)

    def killed_midway(path: Path, ignore_errors: bool = False) -> None:
        (path / "meta.json").unlink()  # the first files are gone when the job is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        remove_old_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000006"]
    assert scan_checkpoints(tmp_path)[1] == {}  # nothing under a checkpoint's name is damaged
    monkeypatch.undo()
    remove_old_checkpoints(tmp_path, keep_last=1)  # the next save finishes what the killed one began
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006"]
