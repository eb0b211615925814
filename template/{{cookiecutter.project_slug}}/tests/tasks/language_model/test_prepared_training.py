"""Training on prepared shards: killed and resumed, it ends bitwise identical to an uninterrupted run; `sample` reads it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from corpus import write_corpus
from helpers import final_weights, losses_by_run, run_cli, train_args

pytestmark = pytest.mark.slow
MAX_STEPS = 16
KILL_AT, RESUMES_AT = 9, 6  # an epoch is about 9 steps here: the resumed run crosses an epoch boundary


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("corpus")
    write_corpus(raw)
    out = tmp_path_factory.mktemp("prepared") / "data"
    result = run_cli("prepare", str(raw), "--out", str(out), "--train_tokenizer", "400", "--val_fraction", "0.1",
                     "--shard_tokens", "1000", "--workers", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) > 3  # windows cross shard boundaries
    return out


def overrides(data: Path) -> list[str]:
    """fsdp2 on the prepared shards, resumed automatically."""
    return [
        "--strategy.name", "fsdp2", "--data.source", "prepared", "--data.path", str(data),
        "--model.vocab_size", "400", "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps",
        str(RESUMES_AT), "--eval.every_steps", "8", "--checkpoint.resume", "auto",
    ]  # fmt: skip


def test_killed_run_on_shards_resumes_bitwise_identical_and_samples(tmp_path: Path, prepared: Path) -> None:
    reference = run_cli(*train_args(tmp_path / "reference", *overrides(prepared)))
    assert reference.returncode == 0, reference.stderr[-3000:]
    (expected_losses,) = losses_by_run(tmp_path / "reference")
    assert sorted(expected_losses) == list(range(1, MAX_STEPS + 1))

    run = tmp_path / "killed"
    killed = run_cli(*train_args(run, *overrides(prepared)), fault=f"kill-at-step:{KILL_AT}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*train_args(run, *overrides(prepared)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{RESUMES_AT:08d} at step {RESUMES_AT}" in resumed.stdout

    before_kill, after_resume = losses_by_run(run)
    assert before_kill == {step: expected_losses[step] for step in range(1, KILL_AT + 1)}  # floats compared exactly
    assert after_resume == {step: expected_losses[step] for step in range(RESUMES_AT + 1, MAX_STEPS + 1)}
    expected, weights = final_weights(tmp_path / "reference", MAX_STEPS), final_weights(run, MAX_STEPS)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)

    # `sample` finds the newest checkpoint of the run, decodes with the prepared folder's tokenizer.
    greedy = [run_cli("sample", str(run), "--prompt", "The fox", "--max_new_tokens", "12", "--temperature", "0")]
    greedy.append(run_cli("sample", str(run / "checkpoints" / f"step-{MAX_STEPS:08d}"), "--prompt", "The fox",
                          "--max_new_tokens", "12", "--temperature", "0"))  # fmt: skip
    assert all(result.returncode == 0 for result in greedy), greedy[0].stderr[-2000:]
    assert greedy[0].stdout.startswith("The fox") and greedy[0].stdout == greedy[1].stdout
    assert len(greedy[0].stdout.strip()) > len("The fox")
