"""What made a run is recorded (checkpoint meta.json, the CSV logger's folder), shown (`checkpoint inspect`, `report`)
and compared at resume: another commit or package version is named in one line, or refused under
checkpoint.on_provenance_change=error.

The machinery's own test: it trains the toy task (tests/toy_task/) on one process, so it runs in every project.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import assert_refused_before_launch, run_cli, toy_train_args

from {{ cookiecutter.package_name }}.checkpoint import provenance
from {{ cookiecutter.package_name }}.checkpoint.provenance import change_line, check_resume, code_version
from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

ONE_PROCESS = ["--devices", "1", "--strategy.name", "ddp", "--eval.every_steps", "0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> Path:
    """4 steps of the toy task on one process, a checkpoint at step 2 and 4."""
    out_dir = tmp_path_factory.mktemp("made") / "run"
    args = toy_train_args(out_dir, *ONE_PROCESS, "--train.max_steps", "4", "--checkpoint.save_every_steps", "2")
    result = run_cli(*args, source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


def saved_provenance(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "meta.json").read_text())["provenance"]


def with_provenance(checkpoint: Path, **changes: object) -> None:
    """Rewrite a checkpoint's recorded provenance (meta.json holds no digest of itself)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    versions = changes.pop("versions", {})
    meta["provenance"] = {**meta["provenance"], **changes}
    meta["provenance"]["versions"].update(versions)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


@pytest.mark.slow  # trains the toy task (the module's run_dir)
def test_every_checkpoint_and_the_csv_config_record_the_versions_hosts_and_launcher(run_dir: Path) -> None:
    logged = json.loads(next((run_dir / "csv").glob("**/version_0/provenance.json")).read_text())
    for step in (2, 4):
        recorded = saved_provenance(run_dir / "checkpoints" / f"step-{step:08d}")
        assert recorded["versions"]["torch"] == torch.__version__
        assert {"python", "lightning"} <= set(recorded["versions"])
        assert recorded["hosts"] == [socket.gethostname()] and recorded["launcher"] == "local"
        assert "commit" in recorded and recorded == logged


@pytest.mark.slow  # trains the toy task (the module's run_dir)
@pytest.mark.usefixtures("toy_task_here")
def test_checkpoint_inspect_and_the_report_show_the_provenance(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["checkpoint", "inspect", str(run_dir)])
    shown = capsys.readouterr().out
    assert f"torch {torch.__version__}" in shown and "launcher     local" in shown and "commit       " in shown
    with contextlib.redirect_stdout(io.StringIO()):
        main(["report", str(run_dir), "--out", str(tmp_path / "report")])
    page = (tmp_path / "report" / "report.html").read_text()
    assert f"torch {torch.__version__}" in page and f"local on {socket.gethostname()}" in page


@pytest.mark.slow  # trains the toy task (the module's run_dir)
def test_a_resume_after_a_package_upgrade_names_it_in_one_line_and_continues(
    run_dir: Path, tmp_path: Path, toy_source: Path
) -> None:
    resumed = tmp_path / "run"
    shutil.copytree(run_dir, resumed)
    with_provenance(resumed / "checkpoints" / "step-00000004", versions={"torch": "2.0.0"})
    args = toy_train_args(resumed, *ONE_PROCESS, "--train.max_steps", "6", "--checkpoint.save_every_steps", "2")
    result = run_cli(*args, source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "resuming from step" in line]
    assert said == [f"warning: resuming from step 4 of commit {_short(run_dir)}; torch 2.0.0 -> {torch.__version__}"]
    assert saved_provenance(resumed / "checkpoints" / "step-00000006")["versions"]["torch"] == torch.__version__


@pytest.mark.slow  # trains the toy task (the module's run_dir)
def test_the_strict_option_refuses_a_resume_of_other_code_before_anything_is_written(
    run_dir: Path, tmp_path: Path, toy_source: Path
) -> None:
    refused = tmp_path / "run"
    shutil.copytree(run_dir, refused)
    with_provenance(refused / "checkpoints" / "step-00000004", commit="1a2b3c4d5e6f", diff_sha256=None)
    args = [*toy_train_args(refused, *ONE_PROCESS, "--train.max_steps", "6"), "--checkpoint.on_provenance_change"]
    message = "resuming from step 4 of commit 1a2b3c4 (now "
    assert_refused_before_launch([*args, "error"], message, refused, tmp_path / "home", source=toy_source)


@pytest.mark.slow  # trains the toy task (the module's run_dir)
def test_a_checkpoint_without_provenance_resumes_with_a_notice_even_when_strict(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    older = tmp_path / "step-00000004"
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", older)
    meta = json.loads((older / "meta.json").read_text())
    del meta["provenance"]
    (older / "meta.json").write_text(json.dumps(meta))
    check_resume(older, parse_recipe(["--checkpoint.on_provenance_change", "error"]), ())
    assert capsys.readouterr().err.strip().splitlines() == [
        "warning: resuming from step 4 of a checkpoint that records no provenance (saved by an older version)"
    ]


# Provenances a hand-edited or foreign meta.json or provenance.json may hold, each read by code that trusts its types.
NOT_PROVENANCE = [
    "made by me",
    {"versions": ["torch"]},
    {"commit": 5},
    {"hosts": "node-1"},
    {"versions": {"torch": 2.13}},
]


@pytest.mark.parametrize("written", NOT_PROVENANCE)
def test_a_provenance_that_is_not_one_is_named_in_one_line_at_resume_and_refused_when_strict(
    written: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"step": 4, "files": {}, "provenance": written}))
    check_resume(tmp_path, parse_recipe([]), ())
    said = "resuming from step 4 of a checkpoint whose provenance is not readable (not as saved)"
    assert capsys.readouterr().err.strip().splitlines() == [f"warning: {said}"]
    with pytest.raises(RecipeError, match=re.escape(said)):
        check_resume(tmp_path, parse_recipe(["--checkpoint.on_provenance_change", "error"]), ())


@pytest.mark.slow  # trains the toy task (the module's run_dir)
@pytest.mark.usefixtures("toy_task_here")
def test_checkpoint_inspect_says_a_provenance_that_is_not_one_is_not_readable(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copied = tmp_path / "step-00000004"
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", copied)
    with_provenance(copied, versions={"torch": ["2.13"]})
    main(["checkpoint", "inspect", str(copied)])
    assert "provenance   not readable" in capsys.readouterr().out


def test_the_same_code_and_versions_say_nothing_and_a_new_diff_is_named() -> None:
    now = {"commit": "5d6e7f8a", "dirty": False, "diff_sha256": None, "versions": {"torch": "2.13.0"}}
    assert change_line(40, now, now) is None
    dirty = {**now, "dirty": True, "diff_sha256": "ab" * 32, "versions": {"torch": "2.13.0", "peft": "0.1"}}
    assert change_line(40, dirty, now) == (
        "resuming from step 40 of commit 5d6e7f8-dirty (now another diff); peft 0.1 -> none"
    )


def test_the_commit_is_read_from_git_when_there_is_a_work_tree_and_null_with_a_reason_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)
    code_version.cache_clear()
    try:
        assert code_version()["commit"] is None and "not a git repository" in code_version()["commit_unknown"]
        code_version.cache_clear()
        git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
        (tmp_path / "code.py").write_text("x = 1\n")
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "code.py"], check=True)
        subprocess.run([*git, "commit", "-qm", "code"], check=True)
        head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
        assert code_version() == {"commit": head, "dirty": False, "diff_sha256": None, "commit_unknown": None}
        code_version.cache_clear()
        (tmp_path / "code.py").write_text("x = 2\n")
        changed = code_version()
        assert changed["commit"] == head and changed["dirty"] and len(changed["diff_sha256"]) == 64
    finally:
        code_version.cache_clear()


def _short(run_dir: Path) -> str:
    return provenance.short_commit(saved_provenance(run_dir / "checkpoints" / "step-00000004"))
