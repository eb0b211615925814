"""Commands that only read recipes start without torch: `--help`, `recipes list`, `plan` and `submit --help` run
with torch made unimportable, and `plan`'s parameter count (computed without torch) is the built model's."""

from __future__ import annotations

import pytest
from helpers import run_cli_without

from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import count_parameters
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import model_parameters


@pytest.mark.parametrize(
    "command", [["--help"], ["recipes", "list"], ["plan", "cpu-debug"], ["submit", "--help"]], ids=" ".join
)
def test_command_runs_without_torch(command: list[str]) -> None:
    result = run_cli_without(("torch",), *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(),
        ModelConfig(vocab_size=1000, block_size=64, n_layer=3, n_head=2, n_embd=48, mlp_ratio=2, bias=True),
    ],
)
def test_the_torch_free_parameter_count_is_the_built_models(config: ModelConfig) -> None:
    assert model_parameters(config) == count_parameters(config)
