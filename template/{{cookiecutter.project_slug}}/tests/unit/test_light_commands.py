"""Commands that only read recipes start without torch: `--help`, `recipes list`, `plan`, `submit --help` and `k8s` run
with torch made unimportable (that `plan`'s parameter count, computed without torch, is the built model's is in
each task's tests: test_sizing.py, test_vit.py)."""

from __future__ import annotations

import pytest
from helpers import run_cli_without


@pytest.mark.parametrize(
    "command",
    [
        ["--help"],
        ["recipes", "list"],
        ["plan", "cpu-debug"],
{%- if cookiecutter.include_slurm == "yes" %}
        ["submit", "--help"],
{%- endif %}
        ["k8s", "cpu-debug", "--kind", "rayjob", "--image", "img", "--pvc", "runs", "--out_dir", "/runs/a"],
    ],
    ids=" ".join,
)
def test_command_runs_without_torch(command: list[str]) -> None:
    result = run_cli_without(("torch",), *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]
