"""Supervised fine-tuning end to end: chat records prepared with `prepare --format sft`, trained packed on 2
processes, killed and resumed bitwise identical to a run never interrupted."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, final_weights, losses_by_run, run_cli

from {{ cookiecutter.package_name }}.tasks.language_model.data.sft import make_demo_conversations

pytestmark = pytest.mark.slow
MAX_STEPS = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 demo conversations as .jsonl, prepared with a tokenizer trained on them (plain template)."""
    folder = tmp_path_factory.mktemp("sft")
    records = folder / "chat.jsonl"
    conversations = make_demo_conversations(400)
    lines = [
        json.dumps({"prompt": c[-2]["content"], "response": c[-1]["content"]} if i % 2 else {"messages": c})
        for i, c in enumerate(conversations)
    ]
    records.write_text("\n".join(lines) + "\n")
    out = folder / "prepared"
    result = run_cli("prepare", str(records), "--train_tokenizer", "300", "--format", "sft", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Prepared 400 examples" in result.stdout and "data.format: sft" in result.stdout
    return out


def train_args(out_dir: Path, prepared: Path) -> list[str]:
    return [
        "train", "--config", str(RECIPES / "cpu-sft-debug.yaml"), "--out_dir", str(out_dir), "--logger.name", "csv",
        "--data.source", "prepared", "--data.path", str(prepared), "--model.vocab_size", "320",
        "--model.n_layer", "1", "--model.block_size", "64", "--train.micro_batch_size", "4", "--eval.batches", "1",
        "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", "4", "--eval.every_steps", "4",
        "--logger.log_every_steps", "1",
    ]  # fmt: skip


def test_a_killed_sft_run_resumes_bitwise_identical(tmp_path: Path, prepared: Path) -> None:
    reference = tmp_path / "reference"
    result = run_cli(*train_args(reference, prepared))
    assert result.returncode == 0, result.stderr[-3000:]
    (expected,) = losses_by_run(reference)
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))

    killed = tmp_path / "killed"
    result = run_cli(*train_args(killed, prepared), fault="kill-at-step:6")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    resumed = run_cli(*train_args(killed, prepared))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000004 at step 4" in resumed.stdout
    before_kill, after_resume = losses_by_run(killed)
    assert before_kill == {step: expected[step] for step in range(1, 7)}  # bitwise: floats compared exactly
    assert after_resume == {step: expected[step] for step in range(5, MAX_STEPS + 1)}
    weights, expected_weights = final_weights(killed, MAX_STEPS), final_weights(reference, MAX_STEPS)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
