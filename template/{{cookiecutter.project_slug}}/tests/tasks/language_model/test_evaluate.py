"""Downstream evaluation through lm-evaluation-harness: a multiple-choice task made here (a YAML file and a jsonl of
8 questions) scored on a checkpoint by `evaluate` and on its Hugging Face export by lm-eval's own Hugging Face
backend gives the same accuracy and per-example log-likelihoods; `eval.tasks` during an fsdp2 run on 2 processes
logs the same scores to the CSV logger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from corpus import write_corpus
from helpers import read_csv_metrics, run_cli, train_args
from lm_eval_task import QUESTIONS, TASK, write_task

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")  # the eval extra
pytest.importorskip("transformers")  # lm-eval's Hugging Face backend (a test dependency, Python 3.11+)

STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(out_dir, task folder) of an fsdp2 run on 2 processes over prepared data, scoring the task every 2 steps."""
    root = tmp_path_factory.mktemp("evaluate")
    write_corpus(root / "raw")
    prepare([str(root / "raw")], str(root / "prepared"), train_tokenizer=300, progress=False)
    tasks = write_task(root / "tasks")
    out_dir = root / "run"
    result = run_cli(
        *train_args(
            out_dir,
            *["--data.source", "prepared", "--data.path", str(root / "prepared"), "--model.vocab_size", "320"],
            *["--train.max_steps", str(STEPS), "--eval.every_steps", "0", "--checkpoint.resume", "null"],
            *["--eval.tasks", f"[{TASK}]", "--eval.tasks_include_path", str(tasks), "--eval.tasks_every_steps", "2"],
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir, tasks


def evaluate(checkpoint: Path, tasks: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """`evaluate CHECKPOINT --tasks TASK --log_samples` in-process; the JSON it wrote beside the checkpoint."""
    main(["evaluate", str(checkpoint), "--tasks", TASK, "--include_path", str(tasks), "--log_samples", "true"])
    written = checkpoint.with_name(checkpoint.name + ".eval.json")
    assert f"Wrote {written}" in capsys.readouterr().out
    return json.loads(written.read_text())


def per_example(results: dict) -> dict[tuple[int, int], float]:
    """(example, choice) -> the choice's log-likelihood, from lm-eval's logged samples."""
    return {
        (sample["doc_id"], choice): float(response[0])
        for sample in results["samples"][TASK]
        for choice, response in enumerate(sample["filtered_resps"])
    }


def test_evaluate_on_the_checkpoint_matches_lm_evals_hugging_face_backend_on_the_export(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir, tasks = trained
    checkpoint = out_dir / "checkpoints" / f"step-{STEPS:08d}"  # sharded (fsdp2), read directly
    ours = evaluate(checkpoint, tasks, capsys)
    main(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"])
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
        tasks=[TASK],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False),
        device="cpu",
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert ours["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
    expected, actual = per_example(reference), per_example(ours)
    assert actual.keys() == expected.keys() and len(actual) == 4 * len(QUESTIONS)
    assert len({round(value, 3) for value in expected.values()}) > len(QUESTIONS)  # the choices are told apart
    for key, value in expected.items():
        assert abs(actual[key] - value) <= 1e-4, f"example {key}: {actual[key]} vs {value}"


def test_eval_tasks_during_training_reach_the_csv_logger_with_evaluates_scores(
    trained: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir, tasks = trained
    logged = {
        int(row["step"]): row[f"eval/{TASK}/acc"] for row in read_csv_metrics(out_dir) if row.get(f"eval/{TASK}/acc")
    }
    assert sorted(logged) == [2, STEPS]
    checkpoint = out_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert float(logged[STEPS]) == evaluate(checkpoint, tasks, capsys)["results"][TASK]["acc,none"]
