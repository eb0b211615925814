"""`prepare` reads Hugging Face datasets (save_to_disk folders, parquet folders, URLs through fsspec) and writes to URLs."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.data import make_demo_text
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare
from {{ cookiecutter.package_name }}.tasks.language_model.data.tokenizer import train_byte_level_bpe

SHARD_TOKENS = 500


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lines = make_demo_text(300).splitlines()
    return [" ".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(train_byte_level_bpe(iter(texts), 300, False).to_str())
    return path


@pytest.fixture(scope="module")
def from_jsonl(tmp_path_factory: pytest.TempPathFactory, texts: list[str], tokenizer_file: Path) -> Path:
    """The texts as one .jsonl file, prepared: what every other input must equal."""
    folder = tmp_path_factory.mktemp("jsonl")
    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return run_prepare([str(folder / "texts.jsonl")], folder / "out", tokenizer_file)


def run_prepare(inputs: list[str], out: Path | str, tokenizer_file: Path) -> Path:
    prepare(
        inputs, str(out), str(tokenizer_file), val_fraction=0.1, workers=1, shard_tokens=SHARD_TOKENS, progress=False
    )
    return Path(out)


def shard_bytes(folder: Path) -> list[bytes]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [(folder / shard["file"]).read_bytes() for shard in manifest["shards"]]


def test_the_texts_in_jsonl_are_the_reference(from_jsonl: Path, texts: list[str], tokenizer_file: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    manifest = json.loads((from_jsonl / "manifest.json").read_text())
    eos = manifest["tokenizer"]["eos_id"]
    reference = np.concatenate([[*tokenizer.encode(text, add_special_tokens=False).ids, eos] for text in texts])
    assert np.array_equal(np.frombuffer(b"".join(shard_bytes(from_jsonl)), dtype=manifest["dtype"]), reference)
    assert manifest["documents"] == len(texts) and len(manifest["shards"]) > 2


def test_a_saved_dataset_and_a_parquet_folder_give_the_shards_of_the_jsonl(
    tmp_path: Path, texts: list[str], tokenizer_file: Path, from_jsonl: Path
) -> None:
    datasets = pytest.importorskip("datasets")  # the dev extra's, on Python 3.11+
    saved = tmp_path / "saved"
    # Three arrow files, read in the order of the folder's state.json; a column besides the text.
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts}).save_to_disk(saved, num_shards=3)
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    half = len(texts) // 2
    pq.write_table(pa.table({"text": texts[:half]}), parquet / "part-0.parquet", row_group_size=7)
    pq.write_table(pa.table({"text": texts[half:]}), parquet / "part-1.parquet")
    expected = shard_bytes(from_jsonl)
    for name, inputs in {"saved": [str(saved)], "parquet": [str(parquet)]}.items():
        folder = run_prepare(inputs, tmp_path / f"{name}-out", tokenizer_file)
        assert shard_bytes(folder) == expected, name
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["documents"] == len(texts)
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["part-0.parquet", "part-1.parquet"]
    # A DatasetDict holds splits: one must be named, not all read into one corpus.
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:3]})}).save_to_disk(tmp_path / "dict")
    with pytest.raises(
        RecipeError, match=r"a DatasetDict of splits train: name one split's folder \(e\.g\. .*/dict/train\)"
    ):
        run_prepare([str(tmp_path / "dict")], tmp_path / "dict-out", tokenizer_file)
    assert not (tmp_path / "dict-out").exists() and not (tmp_path / "dict-out.partial").exists()
    (tmp_path / "broken.arrow").write_bytes(b"not arrow")
    with pytest.raises(RecipeError, match=r"broken\.arrow: not a readable \.arrow file"):
        run_prepare([str(tmp_path / "broken.arrow")], tmp_path / "broken-out", tokenizer_file)


def test_url_inputs_are_read_through_fsspec(
    tmp_path: Path, texts: list[str], tokenizer_file: Path, from_jsonl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memory:// goes the way of s3:// and hf://: listed and read through fsspec. hf:// itself needs the Hub, so
    offline the test shows that it reaches Hugging Face's filesystem and fails in one line."""
    memory = fsspec.filesystem("memory")
    memory.pipe("/corpus/b/texts.jsonl", "".join(json.dumps({"text": text}) + "\n" for text in texts).encode())
    memory.pipe("/corpus/a/ignored.md", b"not an input type")
    try:
        folder = run_prepare(["memory://corpus"], tmp_path / "out", tokenizer_file)
    finally:
        memory.rm("/corpus", recursive=True)
    assert shard_bytes(folder) == shard_bytes(from_jsonl)
    assert json.loads((folder / "manifest.json").read_text())["sources"][0]["path"] == "memory:///corpus/b/texts.jsonl"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import: set where it is read
    with pytest.raises(
        RecipeError,
        match=r"input 'hf://datasets/org/name/\*\.parquet': cannot list it \(Offline.*huggingface\.co/api/datasets/org/name",
    ):
        run_prepare(["hf://datasets/org/name/*.parquet"], tmp_path / "hf-out", tokenizer_file)
    with pytest.raises(RecipeError, match="input 'nope://x': Protocol not known: nope"):
        run_prepare(["nope://x"], tmp_path / "nope-out", tokenizer_file)


def test_out_url_gets_the_files_of_a_folder_manifest_last(
    tmp_path: Path, from_jsonl: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = [str(from_jsonl.parent / "texts.jsonl")]
    names = sorted(path.name for path in from_jsonl.iterdir())
    memory = fsspec.filesystem("memory")
    run_prepare(inputs, "memory://bucket/prepared", tokenizer_file)
    assert sorted(Path(p).name for p in memory.ls("/bucket/prepared", detail=False)) == names
    assert all(memory.cat_file(f"/bucket/prepared/{name}") == (from_jsonl / name).read_bytes() for name in names)
    with pytest.raises(RecipeError, match="--out 'memory://bucket/prepared' already exists"):
        run_prepare(inputs, "memory://bucket/prepared", tokenizer_file)
    run_prepare(inputs, (tmp_path / "by-url").as_uri(), tokenizer_file)  # file://
    assert all((tmp_path / "by-url" / name).read_bytes() == (from_jsonl / name).read_bytes() for name in names)

    # The upload breaks after two files: no manifest at the URL, so nothing there reads as prepared.
    uploaded: list[str] = []
    put_file = type(memory).put_file

    def failing_put_file(self: object, local: str, remote: str, **kwargs: object) -> None:
        if len(uploaded) == 2:
            raise ConnectionError("connection dropped")
        uploaded.append(remote)
        put_file(self, local, remote, **kwargs)

    monkeypatch.setattr(type(memory), "put_file", failing_put_file)
    with pytest.raises(ConnectionError):
        run_prepare(inputs, "memory://bucket/broken", tokenizer_file)
    assert len(memory.ls("/bucket/broken")) == 2 and not memory.exists("/bucket/broken/manifest.json")
    memory.rm("/bucket", recursive=True)
