"""The language model's own bad inputs, its model's fields, its data and its files, refused as every bad input is
(tests/e2e/test_bad_input.py): exit code 2, one line naming the field or path and what is allowed, nothing written;
those a recipe alone decides before torch is imported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    RECIPES,
    assert_one_line_refusal,
    assert_refused_before_launch,
    fail_with,
    outcomes_without_torch,
    train_args,
)

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
        "document mask on sft examples",
        ["--data.format", "sft", "--data.document_mask", "true"],
        "data.document_mask=true applies to data.format=stream (data.format=sft keeps its examples apart already",
    ),
    (
        "document mask without an end-of-document token",
        ["--data.source", "tokens", "--data.path", "tokens.bin", "--data.document_mask", "true"],
        "data.document_mask=true needs an end-of-document token: data.source=tokens names none",
    ),
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


def good_manifest() -> dict:
    """A prepared folder's manifest as `prepare` writes it (its files need not exist: the entries are checked first)."""
    return {
        "task": "language_model",
        "format": 1,
        "dtype": "uint16",
        "tokenizer": {"file": "tokenizer.json", "sha256": "0" * 64, "vocab_size": 300, "eos_id": 0},
        "shards": [{"file": "shard-00000.bin", "tokens": 4096, "sha256": "1" * 64}],
        "validation": {"first_token": 4000, "tokens": 96},
        "tokens": 4096,
    }


# (id, change to the manifest, what the one line must say)
MANIFEST_CASES: list[tuple[str, dict, str]] = [
    ("null tokens", {"shards": [{"file": "shard-00000.bin", "tokens": None, "sha256": "1" * 64}]}, "shards[0] has tokens=None, not an integer"),
    ("no tokenizer key", {"tokenizer": None}, "manifest.json has no 'tokenizer'"),
    ("tokenizer without a digest", {"tokenizer": {"vocab_size": 300}}, "tokenizer has sha256=None, not a string"),
    ("shards as a mapping", {"shards": {"file": "shard-00000.bin"}}, "shards must be a non-empty list of file entries (it is dict)"),
    ("no shards", {"shards": []}, "shards must be a non-empty list of file entries (it is empty)"),
    ("unknown dtype", {"dtype": "float64"}, "dtype 'float64' is not allowed (one of uint16, uint32)"),
    ("a shard named by a path", {"shards": [{"file": "../x.bin", "tokens": 1, "sha256": "1" * 64}]}, "names '../x.bin', not a file in the folder"),
    ("negative tokens", {"shards": [{"file": "s.bin", "tokens": -1, "sha256": "1" * 64}]}, "shards[0] has tokens=-1, must be >= 0"),
]  # fmt: skip


def manifest_folder(tmp: Path, change: dict) -> Path:
    manifest = {**good_manifest(), **change}
    folder = tmp / "prepared"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if v is not None}))
    return folder


@pytest.mark.parametrize(("case_id", "change", "message"), MANIFEST_CASES, ids=[case[0] for case in MANIFEST_CASES])
@pytest.mark.parametrize("command", ["train", "data verify"])
def test_a_malformed_manifest_is_refused_in_one_line_by_every_reader(
    command: str, case_id: str, change: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = manifest_folder(tmp_path, change)
    if command == "train":
        argv = train_args(tmp_path / "run", "--data.source", "prepared", "--data.path", str(folder))
    else:
        argv = ["data", "verify", str(folder)]
    assert message in fail_with(argv, capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "data verify"])
def test_a_listed_file_that_links_outside_the_folder_is_refused_in_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = manifest_folder(tmp_path, {})
    (tmp_path / "secret.json").write_text("{}")
    (folder / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    if command == "train":
        argv = train_args(tmp_path / "run", "--data.source", "prepared", "--data.path", str(folder))
    else:
        argv = ["data", "verify", str(folder)]
    assert "tokenizer.json is a link that leads outside the folder" in fail_with(argv, capsys)
    assert not (tmp_path / "run").exists()


CODE_TASK = "task: code_task\ndataset_path: json\ndataset_kwargs:\n  data_files: {test: data.jsonl}\nprocess_docs: !function utils.process_docs\n"  # fmt: skip
URL_TASK = "task: url_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: https://example.invalid/data.jsonl\n"  # fmt: skip


def task_folder(tmp: Path, yaml_text: str, name: str = "task.yaml") -> Path:
    """A folder of lm-eval task YAML whose utils.py, if ever imported, leaves a marker file beside it."""
    folder = tmp / "tasks"
    folder.mkdir()
    (folder / name).write_text(yaml_text)
    (folder / "utils.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('ran').write_text('code ran')\n"
        "def process_docs(docs):\n    return docs\n"
    )
    return folder


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (CODE_TASK, "runs Python from the folder (process_docs: !function utils.process_docs)"),
        ("include: other.yml\ntask: t\n", "runs Python from the folder"),  # the !function is in the included file
        (URL_TASK, "reads its data from 'https://example.invalid/data.jsonl', which would be downloaded"),
    ],
    ids=["a !function", "a !function in an included file", "a data file at a URL"],
)
def test_evaluate_refuses_a_task_folder_that_runs_code_or_downloads_before_anything_runs(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = task_folder(tmp_path, text)
    (folder / "other.yml").write_text("process_results: !function utils.process_docs\n")
    # No checkpoint at all: the folder is refused first, not the missing checkpoint.
    argv = ["evaluate", str(tmp_path / "no-checkpoint"), "--tasks", "t", "--include_path", str(folder)]
    error = fail_with(argv, capsys)
    assert message in error
    assert not (folder / "ran").exists()


def test_a_recipe_with_a_task_folder_that_runs_code_is_refused_unless_it_allows_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = task_folder(tmp_path, CODE_TASK)
    args = train_args(tmp_path / "run", "--eval.tasks", "[code_task]", "--eval.tasks_include_path", str(folder))
    assert "eval.tasks_allow_code: true" in fail_with(args, capsys)
    assert not (folder / "ran").exists() and not (tmp_path / "run").exists()
    from {{ cookiecutter.package_name }}.tasks.language_model.task_folder import check_task_folder

    check_task_folder(str(folder), True, "eval.tasks_include_path", "")  # allowed by name: accepted
