"""`prepare` turns .txt/.jsonl/.parquet into token shards that decode to the input, byte-identically on every run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from corpus import write_corpus
from helpers import PACKAGE, RECIPES, cli_env, run_cli, train_args
from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.data.sampler import TrainBatches
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import dump_recipe, load_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.config import DataConfig, ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.data import load_splits
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import ShardedTokens, open_prepared
from {{ cookiecutter.package_name }}.tasks.language_model.data.windows import TokenWindows

SHARD_TOKENS = 1000  # several shards, so sequences cross shard boundaries


def prepare_args(inputs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "prepare",
        str(inputs),
        "--out",
        str(out),
        "--val_fraction",
        "0.1",
        "--shard_tokens",
        str(SHARD_TOKENS),
        *extra,
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("corpus")
    return folder, write_corpus(folder)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, corpus: tuple[Path, list[str]]) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    result = run_cli(*prepare_args(corpus[0], out, "--train_tokenizer", "400", "--workers", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data.path: {out}" in result.stdout
    return out


def shard_tokens(folder: Path) -> np.ndarray:
    manifest = json.loads((folder / "manifest.json").read_text())
    return np.concatenate([np.fromfile(folder / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]])


def test_token_counts_equal_a_reference_encode(prepared: Path, corpus: tuple[Path, list[str]]) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    eos = manifest["tokenizer"]["eos_id"]
    reference = [[*tokenizer.encode(doc, add_special_tokens=False).ids, eos] for doc in corpus[1]]
    assert manifest["documents"] == len(corpus[1])
    assert manifest["tokens"] == sum(len(ids) for ids in reference)
    assert [s["tokens"] for s in manifest["shards"]][:-1] == [SHARD_TOKENS] * (len(manifest["shards"]) - 1)
    assert np.array_equal(shard_tokens(prepared), np.concatenate(reference))
    assert manifest["dtype"] == "uint16" and manifest["max_token_id"] < manifest["tokenizer"]["vocab_size"] <= 400
    assert [s["documents"] for s in manifest["sources"]] == [1, 1, 34, 34]  # the empty .jsonl record is skipped


def test_decoded_shards_are_the_input_text(prepared: Path, corpus: tuple[Path, list[str]]) -> None:
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokens = shard_tokens(prepared).tolist()
    ends = [i for i, token in enumerate(tokens) if token == eos]
    starts = [0] + [end + 1 for end in ends[:-1]]
    assert [tokenizer.decode(tokens[s:e]) for s, e in zip(starts, ends, strict=True)] == corpus[1]


def test_validation_split_is_whole_documents_at_the_end(prepared: Path) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    split = manifest["validation"]
    tokens = shard_tokens(prepared)
    assert split["first_token"] + split["tokens"] == len(tokens)
    assert tokens[split["first_token"] - 1] == manifest["tokenizer"]["eos_id"]  # starts at a document
    assert 0.1 <= split["tokens"] / len(tokens) < 0.2 and split["documents"] >= 1
    train, val = load_splits(DataConfig(source="prepared", path=str(prepared)), ModelConfig(vocab_size=400))
    assert len(train) == split["first_token"] and np.array_equal(val[0 : len(val)], tokens[split["first_token"] :])


def test_prepare_twice_gives_identical_bytes_whatever_the_workers(
    tmp_path: Path, prepared: Path, corpus: tuple[Path, list[str]]
) -> None:
    again = tmp_path / "again"
    result = run_cli(*prepare_args(corpus[0], again, "--train_tokenizer", "400", "--workers", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in prepared.iterdir())
    assert names == sorted(p.name for p in again.iterdir()) and "shard-00001.bin" in names
    assert all((prepared / name).read_bytes() == (again / name).read_bytes() for name in names)


def test_a_given_tokenizer_json_gives_the_same_shards(
    tmp_path: Path, prepared: Path, corpus: tuple[Path, list[str]]
) -> None:
    out = tmp_path / "given"
    result = run_cli(*prepare_args(corpus[0], out, "--tokenizer", str(prepared / "tokenizer.json")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.array_equal(shard_tokens(out), shard_tokens(prepared))
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["trained_on_inputs"] is False


def test_shards_read_as_one_array_give_the_batches_of_one_array(prepared: Path) -> None:
    sharded, _ = open_prepared(prepared)
    whole = shard_tokens(prepared)
    assert len(sharded.shards) > 2 and len(sharded) == len(whole)
    for start, stop in [
        (0, 10),
        (SHARD_TOKENS - 5, SHARD_TOKENS + 5),
        (10, 2 * SHARD_TOKENS + 7),
        (len(whole) - 3, len(whole)),
    ]:
        assert np.array_equal(sharded[start:stop], whole[start:stop])
    view = sharded.view(SHARD_TOKENS - 100, len(whole) - 50)
    assert np.array_equal(view[90:120], whole[SHARD_TOKENS - 10 : SHARD_TOKENS + 20])

    def stream(tokens: np.ndarray | ShardedTokens) -> TrainBatches:
        return TrainBatches(TokenWindows(tokens, 64), 4, 2, dp_rank=1, dp_size=2, seed=3)

    from_shards, from_array = stream(sharded), stream(whole)
    for _ in range(40):  # more than an epoch: the order is the same pure function of (seed, samples seen)
        for (x, y), (a, b) in zip(from_shards.next_step(), from_array.next_step(), strict=True):
            assert torch.equal(x, a) and torch.equal(y, b)


def test_interrupted_prepare_is_refused_by_train(tmp_path: Path, corpus: tuple[Path, list[str]]) -> None:
    out = tmp_path / "data"
    partial = tmp_path / "data.partial"
    process = subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *prepare_args(corpus[0], out, "--train_tokenizer", "400", "--workers", "2")],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not partial.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(process.pid, signal.SIGKILL)  # the prepare and its workers, as a lost machine would
    assert process.wait() == -signal.SIGKILL
    assert partial.is_dir() and not out.exists()
    for path, reason in [(out, "unfinished prepare"), (partial, "no manifest.json")]:
        result = run_cli(*train_args(tmp_path / "run", *prepared_data(path)))
        assert result.returncode == 2 and reason in result.stderr, result.stderr[-2000:]
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
        assert not (tmp_path / "run").exists()


def test_a_prepare_asked_to_stop_removes_its_partial_folder_and_runs_again(
    tmp_path: Path, corpus: tuple[Path, list[str]]
) -> None:
    out = tmp_path / "data"
    partial = tmp_path / "data.partial"
    args = prepare_args(corpus[0], out, "--train_tokenizer", "400")
    process = subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *args], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not partial.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    process.send_signal(signal.SIGTERM)  # a scheduler's or a user's kill, mid-write
    assert process.wait() == 128 + signal.SIGTERM, process.stderr.read() if process.stderr else ""
    assert not partial.exists() and not out.exists()
    result = run_cli(*args)  # nothing left behind blocks the rerun
    assert result.returncode == 0 and (out / "manifest.json").is_file(), result.stderr[-2000:]


def prepared_data(data: Path, *extra: str) -> list[str]:
    """Overrides that train on a prepared folder (its tokenizer has 400 tokens)."""
    return ["--data.source", "prepared", "--data.path", str(data), "--model.vocab_size", "400", *extra]


def damaged_copy(prepared: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(prepared, copy)
    shard = copy / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize(
    "case",
    ["missing tokenizer", "vocab_size below the tokenizer's", "jsonl without the text field", "empty input",
     "empty files", "shard checksum mismatch", "both tokenizer options", "output exists"],
)  # fmt: skip
def test_bad_inputs_exit_2_with_one_line(
    tmp_path: Path, prepared: Path, corpus: tuple[Path, list[str]], case: str
) -> None:
    out = tmp_path / "out"
    empty, empty_files = tmp_path / "empty", tmp_path / "empty-files"
    empty.mkdir()
    empty_files.mkdir()
    (empty_files / "x.txt").touch()
    (empty_files / "y.jsonl").touch()
    args, expected = {
        "missing tokenizer": (
            prepare_args(corpus[0], out, "--tokenizer", str(tmp_path / "nope.json")),
            f"--tokenizer '{tmp_path / 'nope.json'}': no such file",
        ),
        "vocab_size below the tokenizer's": (
            train_args(tmp_path / "run", *prepared_data(prepared, "--model.vocab_size", "256")),
            "model.vocab_size=256 is smaller than the vocabulary of data.path=",
        ),
        "jsonl without the text field": (
            prepare_args(corpus[0] / "c.jsonl", out, "--train_tokenizer", "300", "--text_field", "body"),
            f"{corpus[0] / 'c.jsonl'}:1: no text field 'body' (found: id, text; choose with --text_field)",
        ),
        "empty input": (
            prepare_args(empty, out, "--train_tokenizer", "300"),
            "no .txt, .jsonl, .parquet, .arrow files found",
        ),
        "empty files": (
            prepare_args(empty_files, out, "--train_tokenizer", "300"),
            "all 2 files are empty (empty input)",
        ),
        "shard checksum mismatch": (
            train_args(tmp_path / "run", *prepared_data(damaged_copy(prepared, tmp_path), "--data.verify", "full")),
            "shard-00001.bin does not match its sha256 in manifest.json",
        ),
        "output exists": (prepare_args(corpus[0], prepared, "--train_tokenizer", "300"), "already exists"),
        "both tokenizer options": (
            prepare_args(corpus[0], out, "--train_tokenizer", "300", "--tokenizer", str(prepared / "tokenizer.json")),
            "exactly one of --tokenizer",
        ),
    }[case]
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists() and not (tmp_path / "run").exists()


def test_start_checks_sizes_and_data_verify_reads_every_byte(prepared: Path, tmp_path: Path) -> None:
    """Opening a folder stats its files (a shard of another size is refused) but reads no shard's bytes: a changed
    byte passes unless `data.verify: full`; `data verify` finds it, naming the shard, in one line with exit 2."""
    damaged = damaged_copy(prepared, tmp_path)
    tokens, _ = open_prepared(damaged)
    assert len(tokens) == len(open_prepared(prepared)[0])
    with pytest.raises(RecipeError, match=r"shard-00001\.bin does not match its sha256"):
        open_prepared(damaged, checksums=True)

    intact = run_cli("data", "verify", str(prepared))
    assert intact.returncode == 0, intact.stderr
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["task"] == "language_model"  # the task `data verify` reads the folder with
    assert f"{prepared}: every file matches its manifest: {manifest['tokens']:,} tokens in" in intact.stdout
    refused = run_cli("data", "verify", str(damaged))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: PATH={str(damaged)!r}: shard-00001.bin does not match its sha256")

    with (damaged / "shard-00002.bin").open("ab") as shard:
        shard.write(b"\0\0")
    with pytest.raises(RecipeError, match=r"shard-00002\.bin has \d+ bytes, manifest.json says \d+"):
        open_prepared(damaged)


def test_a_manifest_that_names_no_task_is_read_with_the_projects(prepared: Path, tmp_path: Path) -> None:
    """A folder prepared before manifests named their task still verifies."""
    older = tmp_path / "older"
    shutil.copytree(prepared, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["task"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("data", "verify", str(older))
    assert result.returncode == 0 and f"{older}: every file matches its manifest" in result.stdout, result.stderr


def test_a_manifest_without_its_tokenizer_is_refused_in_one_line(prepared: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(prepared, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["tokenizer"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match=r"manifest\.json has no 'tokenizer': not a complete prepare"):
        open_prepared(damaged)
    result = run_cli("data", "verify", str(damaged))
    assert result.returncode == 2 and "has no 'tokenizer'" in result.stderr and "Traceback" not in result.stderr


def test_small_train_tokenizer_size_is_refused(tmp_path: Path, corpus: tuple[Path, list[str]]) -> None:
    result = run_cli(*prepare_args(corpus[0], tmp_path / "out", "--train_tokenizer", "100"))
    assert result.returncode == 2 and "needs at least 257 tokens" in result.stderr, result.stderr
    assert not (tmp_path / "out.partial").exists()


def test_recipes_validate_checks_the_prepared_folder(tmp_path: Path, prepared: Path) -> None:
    recipe = load_recipe(RECIPES / "cpu-debug.yaml")
    recipe.data = DataConfig(source="prepared", path=str(prepared))
    recipe.model.vocab_size = 400
    (tmp_path / "ok.yaml").write_text(dump_recipe(recipe))
    recipe.data.path = str(tmp_path / "not-yet")
    (tmp_path / "later.yaml").write_text(dump_recipe(recipe))
    recipe.data.path, recipe.model.vocab_size = str(prepared), 300
    (tmp_path / "small.yaml").write_text(dump_recipe(recipe))

    result = run_cli("recipes", "validate", str(tmp_path / "ok.yaml"), str(tmp_path / "later.yaml"))
    assert result.returncode == 0, result.stderr
    assert f"    data: {json.loads((prepared / 'manifest.json').read_text())['tokens']:,} tokens in" in result.stdout
    assert f"data: {tmp_path / 'not-yet'} is not prepared yet" in result.stdout
    refused = run_cli("recipes", "validate", str(tmp_path / "small.yaml"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "model.vocab_size=300 is smaller than the vocabulary" in refused.stderr


def test_the_vocabulary_check_reads_the_folders_tokenizer_not_the_manifests_claim(
    tmp_path: Path, prepared: Path
) -> None:
    import shutil

    claimed = tmp_path / "claimed"
    shutil.copytree(prepared, claimed)
    manifest = json.loads((claimed / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"], manifest["max_token_id"] = 100, 99  # an edited manifest: "ids below 100"
    (claimed / "manifest.json").write_text(json.dumps(manifest))
    recipe = load_recipe(RECIPES / "cpu-debug.yaml")
    recipe.data, recipe.model.vocab_size = DataConfig(source="prepared", path=str(claimed)), 256
    (tmp_path / "small.yaml").write_text(dump_recipe(recipe))
    refused = run_cli("recipes", "validate", str(tmp_path / "small.yaml"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert (
        "(400 tokens in its tokenizer.json, ids up to 99 in its shards): set model.vocab_size >= 400" in refused.stderr
    )


def test_a_record_without_the_text_field_midway_leaves_nothing_behind(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "first"}), json.dumps({"text": "second"}), json.dumps({"body": "third"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError, match=r"in\.jsonl:3: no text field 'text' \(found: body"):
        prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), train_tokenizer=300, workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_prepare_never_deletes_a_partial_folder_it_did_not_make(tmp_path: Path, corpus: tuple[Path, list[str]]) -> None:
    left = tmp_path / "out.partial"
    left.mkdir()
    (left / "notes.txt").write_text("keep")
    result = run_cli(*prepare_args(corpus[0], tmp_path / "out", "--train_tokenizer", "400"))
    assert result.returncode == 2 and "out.partial exists" in result.stderr, result.stderr
    assert (left / "notes.txt").read_text() == "keep" and not (tmp_path / "out").exists()
