"""`prepare --engine ray`: tokenizing in Ray tasks on a local cluster of 2 workers gives the one-machine folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from corpus import write_corpus
from helpers import PROJECT, run_cli_without

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.data.distributed import split_sources
from {{ cookiecutter.package_name }}.tasks.language_model.data.inputs import find_inputs
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    """One local Ray instance for the module (it takes seconds to start): 2 CPUs, the package importable."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT / "src"), previous]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = previous


def test_ray_tasks_write_the_bytes_of_a_one_machine_prepare(tmp_path: Path, local_cluster: None) -> None:
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    assert [len(run) for run in split_sources(find_inputs([str(corpus)]), 2)] == [2, 2]  # two tasks of two files
    options = {"val_fraction": 0.1, "shard_tokens": 1000, "progress": False}
    prepare([str(corpus)], str(tmp_path / "local"), train_tokenizer=400, workers=2, **options)  # type: ignore[arg-type]
    tokenizer = str(tmp_path / "local" / "tokenizer.json")
    prepare([str(corpus)], str(tmp_path / "ray"), tokenizer, engine="ray", tasks=2, **options)  # type: ignore[arg-type]
    names = sorted(path.name for path in (tmp_path / "local").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "ray").iterdir()) and "shard-00001.bin" in names
    for name in names:
        local, distributed = (tmp_path / "local" / name).read_bytes(), (tmp_path / "ray" / name).read_bytes()
        if name == "manifest.json":  # the one difference: the tokenizer was trained for the first, given to the second
            local = local.replace(b'"trained_on_inputs": true', b'"trained_on_inputs": false')
        assert local == distributed, name
    # A record without the text field in a later line is found by its task: the same one line as on one machine.
    with (corpus / "c.jsonl").open("a") as jsonl:
        jsonl.write('{"id": 99}\n')
    with pytest.raises(RecipeError, match=r"c\.jsonl:\d+: no text field 'text' \(found: id;") as refused:
        prepare([str(corpus)], str(tmp_path / "bad"), tokenizer, engine="ray", tasks=2, **options)  # type: ignore[arg-type]
    assert type(refused.value) is RecipeError and not (tmp_path / "bad").exists()
    assert not (tmp_path / "bad.partial").exists()


def test_engine_ray_without_ray_is_one_line(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    result = run_cli_without(("ray",), "prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "out"),
                             "--train_tokenizer", "300", "--engine", "ray")  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--engine ray needs Ray, which is not installed here (pip install '{{ cookiecutter.project_slug }}[ray]')" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"engine": "spark"}, "--engine 'spark': use one of local, ray"),
        ({"tasks": 2}, "--tasks counts the tasks of --engine ray; with --engine local, use --workers"),
        (
            {"engine": "ray", "workers": 2},
            "--workers counts the processes of --engine local; with --engine ray, use --tasks",
        ),
        ({"engine": "ray", "tasks": 0}, "--tasks 0 and --shard_tokens"),
    ],
)
def test_engine_options_are_checked_before_anything_is_read(tmp_path: Path, options: dict, expected: str) -> None:
    with pytest.raises(RecipeError) as refused:
        prepare([str(tmp_path / "nothing-here")], str(tmp_path / "out"), train_tokenizer=300, **options)
    assert expected in str(refused.value) and not (tmp_path / "out.partial").exists()
