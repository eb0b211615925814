"""The language model's own bad inputs, its model's fields, its data and its files, refused as every bad input is
(tests/e2e/test_bad_input.py): exit code 2, one line naming the field or path and what is allowed, nothing written;
those a recipe alone decides before torch is imported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import RECIPES, assert_one_line_refusal, assert_refused_before_launch, outcomes_without_torch

RECIPE = RECIPES / "cpu-debug.yaml"

# (id, overrides of cpu-debug, what the one line must say)
RECIPE_ONLY: list[tuple[str, list[str], str]] = [
    ("heads not dividing the width", ["--model.n_head", "3"], "model.n_head=3 does not divide model.n_embd=128"),
    ("vocabulary too small for bytes", ["--model.vocab_size", "100"], "model.vocab_size=100 is too small"),
    ("dropout of 1.5", ["--model.dropout", "1.5"], "model.dropout=1.5 must be in [0, 1)"),
    ("empty context", ["--model.block_size", "0"], "model.block_size=0 must be >= 1"),
    ("negative depth", ["--model.n_layer", "-1"], "model.n_layer=-1 must be >= 1"),
    ("no MLP", ["--model.mlp_ratio", "0"], "model.mlp_ratio=0 must be >= 1"),
    ("unknown model family", ["--model.arch", "rnn"], "model.arch: 'rnn' is not allowed"),
    ("text data without a path", ["--data.source", "text"], "data.path is required when data.source=text"),
    ("validation share of 1.5", ["--data.val_fraction", "1.5"], "data.val_fraction=1.5 must be in (0, 1)"),
    ("unknown data source", ["--data.source", "parquet"], "data.source: 'parquet' is not allowed"),
    ("unknown token type", ["--data.token_dtype", "int8"], "data.token_dtype: 'int8' is not allowed"),
    (
        "expert parallel without experts",
        ["--strategy.fsdp2.expert_parallel_size", "2"],
        "strategy.fsdp2.expert_parallel_size=2: task=language_model's model has no experts to split (set it to 1)",
    ),
]


@pytest.fixture(scope="module")
def refused_without_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """case id -> (exit code, stderr, seconds) of every recipe-only case, run where torch cannot be imported."""
    folder = tmp_path_factory.mktemp("lm_recipe_only")
    cases = {
        case_id: ["train", "--config", str(RECIPE), "--out_dir", str(folder / f"out-{index}"), *overrides]
        for index, (case_id, overrides, _) in enumerate(RECIPE_ONLY)
    }
    outcomes = outcomes_without_torch(cases, folder)
    assert not [path for path in folder.iterdir() if path.name.startswith("out-")], "an out_dir was created"
    return outcomes


def test_the_language_model_adds_over_ten_bad_inputs_of_its_own() -> None:
    """With the machinery's (over forty), a language model project checks over fifty bad inputs."""
    assert len(RECIPE_ONLY) + len(STATE_CASES) > 10


@pytest.mark.parametrize(("case_id", "message"), [(case[0], case[2]) for case in RECIPE_ONLY], ids=lambda v: v)
def test_a_bad_language_model_recipe_is_refused_in_one_line_before_torch_is_imported(
    refused_without_torch: dict[str, dict], case_id: str, message: str
) -> None:
    outcome = refused_without_torch[case_id]
    assert_one_line_refusal(outcome["code"], outcome["stderr"], message)
    assert outcome["seconds"] < 10


def token_beyond_the_vocabulary(tmp: Path) -> tuple[list[str], Path]:
    tokens = np.arange(4096, dtype=np.uint16) % 256
    tokens[1000] = 300
    tokens.tofile(tmp / "tokens.bin")
    return [
        "--data.source",
        "tokens",
        "--data.path",
        str(tmp / "tokens.bin"),
        "--out_dir",
        str(tmp / "run"),
    ], tmp / "run"


def missing_token_file(tmp: Path) -> tuple[list[str], Path]:
    return ["--data.source", "tokens", "--data.path", str(tmp / "nope.bin"), "--out_dir", str(tmp / "run")], tmp / "run"


def text_folder_without_text(tmp: Path) -> tuple[list[str], Path]:
    (tmp / "texts").mkdir()
    return ["--data.source", "text", "--data.path", str(tmp / "texts"), "--out_dir", str(tmp / "run")], tmp / "run"


STATE_CASES = [
    (token_beyond_the_vocabulary, "holds token id 300, beyond model.vocab_size=256"),
    (missing_token_file, "token file not found"),
    (text_folder_without_text, "no .txt files found"),
]


@pytest.mark.slow  # each case starts a process that imports torch
@pytest.mark.parametrize(("make", "message"), STATE_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_bad_data_is_refused_before_launch_and_leaves_everything_as_it_was(make, message: str, tmp_path: Path) -> None:
    overrides, out_dir = make(tmp_path)
    assert_refused_before_launch(["train", "--config", str(RECIPE), *overrides], message, out_dir, tmp_path)
