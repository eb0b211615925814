"""A checkpoint's meta.json as any file may be: a list, files that are not a table, a file recorded as neither a
size nor a size and digest, a complete folder without its strategy. Every reader says so in one line (listing
names the folder incomplete; inspect, consolidate and resume refuse it), none with a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TOY_RECIPE, fail_with

from {{ cookiecutter.package_name }}.cli import main

# (id, meta.json's content, why the folder is not a checkpoint, as the line says it)
BAD_META = [
    ("a list", [1, 2], "meta.json is not an object with a 'files' table"),
    ("files as a list", {"step": 4, "files": ["state/x"]}, "meta.json is not an object with a 'files' table"),
    ("a file recorded as a word", {"step": 4, "files": {"state/x": "big"}}, "meta.json records state/x as 'big'"),
    ("a file record without its digest", {"step": 4, "files": {"state/x": {"bytes": 3}}}, "meta.json records state/x"),
]  # fmt: skip


def checkpoint(run: Path, meta: object) -> Path:
    folder = run / "checkpoints" / "step-00000004"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "x").write_bytes(b"abc")
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.usefixtures("toy_task_here")
@pytest.mark.parametrize(("case_id", "meta", "why"), BAD_META, ids=[case[0] for case in BAD_META])
def test_a_malformed_meta_json_is_named_by_list_and_refused_by_inspect_and_resume_in_one_line(
    case_id: str, meta: object, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = checkpoint(tmp_path / "run", meta)
    main(["checkpoint", "list", str(tmp_path / "run")])
    assert f"INCOMPLETE: {why}" in capsys.readouterr().out
    assert f"not a complete checkpoint: {why}" in fail_with(["checkpoint", "inspect", str(folder)], capsys)
    argv = [
        "train",
        "--config",
        str(TOY_RECIPE),
        "--out_dir",
        str(tmp_path / "new"),
        "--checkpoint.resume",
        str(folder),
    ]
    assert f"not a complete checkpoint: {why}" in fail_with(argv, capsys)
    assert not (tmp_path / "new").exists()


def test_a_complete_folder_whose_meta_json_has_no_strategy_is_refused_by_inspect_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = checkpoint(tmp_path / "run", {"step": 4, "files": {"state/x": 3}})
    assert "meta.json has no 'strategy'" in fail_with(["checkpoint", "inspect", str(folder)], capsys)


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_partial_output_is_removed_when_its_command_is_asked_to_stop(kind: str, tmp_path: Path) -> None:
    """export, consolidate and prepare write through this: SIGTERM mid-write exits 143 and leaves no `.partial`."""
    import os
    import signal

    from {{ cookiecutter.package_name }}.checkpoint.layout import new_partial, removed_unless_finished

    partial = new_partial(tmp_path / "out") if kind == "folder" else tmp_path / "weights.pt.partial"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited, removed_unless_finished(partial):
        (partial / "model.safetensors" if kind == "folder" else partial).write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM
    assert not partial.exists() and signal.getsignal(signal.SIGTERM) is before  # the handler put back


@pytest.mark.usefixtures("toy_task_here")
def test_a_meta_json_without_its_step_is_refused_by_resume_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Complete by its files table, but without the step a resume names (the provenance check reads it first)."""
    folder = checkpoint(tmp_path / "run", {"files": {"state/x": 3}, "strategy": "ddp"})
    resume = ["--out_dir", str(tmp_path / "new"), "--checkpoint.resume", str(folder)]
    assert "meta.json has no 'step' (not a complete checkpoint's)" in fail_with(
        ["train", "--config", str(TOY_RECIPE), *resume], capsys
    )
    assert not (tmp_path / "new").exists()
