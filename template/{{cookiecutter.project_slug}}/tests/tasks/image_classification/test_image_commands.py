"""The image classifier's command line refuses bad input in one line with exit code 2, before anything is written:
recipe fields that do not fit the model or the data, an image folder that is not one, a missing checkpoint (a
missing image: tests/tasks/image_classification/test_image_classification.py, which has a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RECIPES, fail_with

CPU_DEBUG = ["--config", str(RECIPES / "cpu-debug.yaml")]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.patch_size", "3"], "model.patch_size=3 does not divide model.image_size=8"),
        (["--model.n_head", "3"], "model.n_head=3 does not divide model.n_embd=64"),
        (["--model.image_size", "16"], "data.source=digits holds 8x8 grey images"),
        (["--model.num_classes", "5"], "model.num_classes=5 is too small for data.source=digits"),
        (["--data.source", "prepared"], "data.path is required when data.source=prepared"),
        (["--data.crop_padding", "8"], "data.crop_padding=8 must be in [0, model.image_size)"),
        (["--data.source", "tokens"], "data.source"),
        (["--model.vocab_size", "256"], "unknown option '--model.vocab_size'"),
        (["--strategy.fsdp2.tensor_parallel_size", "3", "--devices", "3"], "model.n_head"),
        (
            ["--strategy.name", "fsdp2", "--devices", "2", "--strategy.fsdp2.context_parallel_size", "2"],
            "strategy.fsdp2.context_parallel_size=2: task=image_classification has no sequence to split (set it to 1)",
        ),
    ],
)
def test_a_recipe_that_does_not_fit_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    err = fail_with(["train", *CPU_DEBUG, "--out_dir", str(tmp_path / "run"), *overrides], capsys)
    assert message in err
    assert not (tmp_path / "run").exists()


def test_prepare_refuses_a_folder_without_classes_and_an_existing_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"not read")
    err = fail_with(["prepare", str(tmp_path / "flat"), "--out", str(tmp_path / "out"), "--image_size", "8"], capsys)
    assert "flat" in err and not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    (tmp_path / "out").mkdir()
    err = fail_with(["prepare", str(tmp_path / "flat"), "--out", str(tmp_path / "out"), "--image_size", "8"], capsys)
    assert "out" in err


def test_predict_refuses_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["predict", str(tmp_path / "nowhere"), str(tmp_path / "a.png")], capsys)
    assert "nowhere" in err


def test_prepare_never_deletes_a_partial_folder_it_did_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    for label in ("a", "b"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for index in range(2):
            Image.new("L", (8, 8), color=index * 100).save(tmp_path / "images" / label / f"{index}.png")
    left = tmp_path / "out.partial"
    left.mkdir()
    (left / "notes.txt").write_text("keep")
    err = fail_with(["prepare", str(tmp_path / "images"), "--out", str(tmp_path / "out"), "--image_size", "8"], capsys)
    assert "out.partial exists" in err
    assert (left / "notes.txt").read_text() == "keep" and not (tmp_path / "out").exists()
