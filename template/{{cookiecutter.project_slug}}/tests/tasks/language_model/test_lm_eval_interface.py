"""The project's model behind lm-eval's interface, on a byte-level checkpoint: rolling log-likelihoods are the model's
own sums, generation is `sample`'s greedy continuation cut at the stop string; a task that needs a download and
eval.tasks settings that cannot run are refused in one line, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import fail_with, train_args
from test_sample import write_checkpoint

from {{ cookiecutter.package_name }}.checkpoint.tensors import load_model
from {{ cookiecutter.package_name }}.tasks.language_model.sample import generate

pytest.importorskip("lm_eval")  # the eval extra
from lm_eval.api.instance import Instance

from {{ cookiecutter.package_name }}.tasks.language_model.evaluate import project_lm


def request(kind: str, *arguments: object) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)  # type: ignore[arg-type]


def test_the_models_answers_to_lm_evals_requests_are_its_own_scores_and_greedy_text(tmp_path: Path) -> None:
    model, recipe = load_model(write_checkpoint(tmp_path / "run"))  # byte-level tokens, block_size 32
    lm = project_lm(model, recipe, torch.device("cpu"), batch_size=2)

    def log_likelihood(context: list[int], continuation: list[int]) -> float:  # by the model directly
        ids = context + continuation
        with torch.no_grad():
            log_probs = F.log_softmax(model(torch.tensor([ids[:-1]])), dim=-1)[0, len(context) - 1 :]
        return float(log_probs.gather(-1, torch.tensor(continuation)[:, None]).sum())

    text = "a short text of bytes"  # one window: the end-of-document token (a newline for bytes), then the text
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])[0]
    assert rolling == pytest.approx(log_likelihood([10], list(text.encode())), abs=1e-4)

    greedy = generate(model, list(b"the"), 12, temperature=0, top_k=None, seed=0)[3:]
    assert 10 not in greedy and all(byte < 128 for byte in greedy[:2])  # this checkpoint's: no newline, ASCII first
    written = bytes(greedy).decode("utf-8", errors="replace")
    never = {"until": ["never written"], "max_gen_toks": 12}
    assert lm.generate_until([request("generate_until", "the", never)]) == [written]
    stop = next(chr(byte) for byte in greedy[2:] if chr(byte).isascii() and chr(byte).isalnum())
    until = {"until": [stop], "max_gen_toks": 12}
    assert lm.generate_until([request("generate_until", "the", until)]) == [written.split(stop)[0]]

    [(score, is_greedy)] = lm.loglikelihood([request("loglikelihood", "the", written[:2])])
    assert is_greedy and score == pytest.approx(log_likelihood(list(b"the"), greedy[:2]), abs=1e-4)


HUB_TASK = "task: needs_the_hub\ndataset_path: Rowan/hellaswag\nvalidation_split: validation\n"
HUB_TASK += "output_type: multiple_choice\ndoc_to_text: ctx\ndoc_to_choice: endings\ndoc_to_target: label\n"


@pytest.mark.parametrize(
    "task",
    [
        "needs_the_hub",  # a local YAML task naming a data set of the Hub
        pytest.param("hellaswag", marks=pytest.mark.matrix),  # one of lm-eval's (indexing its library takes seconds)
    ],
)
def test_a_task_whose_data_must_be_downloaded_is_refused_in_one_line(
    tmp_path: Path, task: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_checkpoint(tmp_path / "run")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "needs_the_hub.yaml").write_text(HUB_TASK)
    arguments = ["--tasks", task, "--include_path", str(tmp_path / "tasks")]
    err = fail_with(["evaluate", str(tmp_path / "run"), *arguments], capsys)
    assert err.startswith(f"error: --tasks: {task} needs a data set that is not in the local Hugging Face cache")
    assert "Rowan/hellaswag" in err
    assert not list((tmp_path / "run" / "checkpoints").glob("*.json"))  # nothing written


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--eval.tasks_include_path", "no-such-folder"], "eval.tasks_include_path=no-such-folder is not a folder"),
        (["--eval.every_steps", "0"], "eval.tasks are set but never run"),
        (["--eval.tasks_limit", "0"], "eval.tasks_limit=0.0 must be > 0"),
    ],
)
def test_eval_tasks_that_cannot_run_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], expected: str
) -> None:
    err = fail_with(train_args(tmp_path / "run", "--eval.tasks", "[some_task]", *overrides), capsys)
    assert expected in err


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--device", "abacus"], "--device 'abacus' is not a device"),
        (["--batch_size", "0"], "--batch_size 0 must be >= 1"),
        (["--limit", "0"], "--limit 0 must be > 0"),
    ],
)
def test_bad_evaluate_arguments_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], expected: str
) -> None:
    write_checkpoint(tmp_path / "run")
    assert expected in fail_with(["evaluate", str(tmp_path / "run"), "--tasks", "x", *arguments], capsys)


def test_without_lm_eval_evaluate_and_eval_tasks_say_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # any import of it now raises ImportError, as where it is absent
    write_checkpoint(tmp_path / "run")
    assert fail_with(["evaluate", str(tmp_path / "run"), "--tasks", "x"], capsys).endswith("pip install .[eval]")
    err = fail_with(train_args(tmp_path / "run", "--eval.tasks", "[x]"), capsys)
    assert err.endswith("eval.tasks needs lm-evaluation-harness: pip install .[eval]")
