"""`data verify` reads a prepared folder with the task whose `prepare` wrote it (the manifest's "task"), else with
the project's task; a folder of a task the project does not have is refused in one line. The tasks' own readers
(every byte against the manifest) are tested with each task's `prepare`: test_prepare.py, test_image_data.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fail_with

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.project import TASK
from {{ cookiecutter.package_name }}.tasks import REGISTRY, Task


class Verifier(Task):
    """A task whose reader only says which task read the folder."""

    name = "verifier"

    @classmethod
    def verify_prepared(cls, folder: Path) -> str:
        return f"read by {cls.name}"


@pytest.fixture
def tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's task and a second one, both a Verifier: what reads a folder is in the line printed."""
    monkeypatch.setitem(REGISTRY, Verifier.name, Verifier)
    monkeypatch.setitem(REGISTRY, TASK, type("ProjectVerifier", (Verifier,), {"name": TASK}))


def prepared(tmp_path: Path, manifest: dict[str, object]) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize(
    ("manifest", "reader"),
    [({"task": "verifier", "format": 1}, "verifier"), ({"format": 1}, TASK)],
    ids=["the task the manifest names", "the project's task when it names none"],
)
@pytest.mark.usefixtures("tasks")
def test_data_verify_reads_a_folder_with_the_task_that_prepared_it(
    manifest: dict[str, object], reader: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = prepared(tmp_path, manifest)
    main(["data", "verify", str(folder)])
    assert capsys.readouterr().out == f"{folder}: every file matches its manifest: read by {reader}\n"


def test_a_folder_of_a_task_the_project_does_not_have_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = prepared(tmp_path, {"task": "speech", "format": 1})
    refused = fail_with(["data", "verify", str(folder)], capsys)
    assert f"PATH={str(folder)!r}: manifest.json says task 'speech' prepared it" in refused
    assert f"(its tasks: {TASK})" in refused
