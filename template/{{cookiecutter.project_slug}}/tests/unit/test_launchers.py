"""Launchers agree with the recipe or are refused."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import RECIPES

from {{ cookiecutter.package_name }}.cluster import prestart
from {{ cookiecutter.package_name }}.cluster.launchers import check_launcher
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe

LAUNCHER_VARIABLES = ("LT_CLI_USED", "LT_DEVICES", "LT_NUM_NODES", "LT_ACCELERATOR", "LT_STRATEGY", "LT_PRECISION")
LAUNCHER_VARIABLES += ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def fabric_run(monkeypatch: pytest.MonkeyPatch, **flags: str) -> None:
    """The environment `fabric run` gives its processes (it always exports devices and nodes)."""
    monkeypatch.setenv("LT_CLI_USED", "1")
    for name, value in {"devices": "1", "num_nodes": "1", **flags}.items():
        monkeypatch.setenv(f"LT_{name.upper()}", value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"devices": "1"}, "fabric run --devices=1 conflicts with the recipe's devices=2 (the recipe decides"),
        ({"devices": "2", "num_nodes": "4"}, "fabric run --num-nodes=4 conflicts with the recipe's num_nodes=1"),
        (
            {"devices": "2", "strategy": "ddp"},
            "fabric run --strategy=ddp conflicts with the recipe's strategy.name=fsdp2",
        ),
        (
            {"devices": "2", "precision": "bf16"},
            "fabric run --precision=bf16 conflicts with the recipe's precision=32-true",
        ),
        (
            {"devices": "2", "accelerator": "cuda"},
            "fabric run --accelerator=cuda conflicts with the recipe's accelerator=cpu",
        ),
    ],
)
def test_fabric_run_flags_must_match_the_recipe(clean_env: pytest.MonkeyPatch, flags: dict, message: str) -> None:
    fabric_run(clean_env, **flags)
    with pytest.raises(RecipeError) as error:
        check_launcher(load_recipe(RECIPES / "cpu-debug.yaml"), "cpu")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_matching_fabric_run_flags_are_accepted_and_handed_back_to_the_recipe(clean_env: pytest.MonkeyPatch) -> None:
    # Aliases count as equal (0,1 is two devices, bf16 is bf16-mixed); then Fabric gets the recipe's own values.
    fabric_run(clean_env, devices="0,1", num_nodes="1", accelerator="cpu", strategy="fsdp2", precision="bf16")
    recipe = parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), "--precision", "bf16-mixed"])
    check_launcher(recipe, "cpu")
    assert [name for name in LAUNCHER_VARIABLES[1:6] if name in os.environ] == []
    assert os.environ["LT_CLI_USED"] == "1"


def test_torchrun_with_another_world_size_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHELASTIC_RUN_ID", "job")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"^torchrun started 4 process\(es\), 2 per node, but the recipe asks for"):
        check_launcher(load_recipe(RECIPES / "cpu-debug.yaml"), "cpu")
    clean_env.setenv("WORLD_SIZE", "2")
    check_launcher(load_recipe(RECIPES / "cpu-debug.yaml"), "cpu")


def test_srun_with_another_task_count_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_JOB_NAME", "train")
    with pytest.raises(RecipeError, match=r"^srun started 8 task\(s\) but the recipe asks for devices=2 x num_nodes=1"):
        check_launcher(load_recipe(RECIPES / "cpu-debug.yaml"), "cpu")


@pytest.fixture
def first_rank(clean_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process started by hand as `<project> train --config cpu-debug.yaml`, on a machine without GPUs."""
    for name in ("LOCAL_RANK", "RANK", "TRAIN_RAY_WORKER", prestart.SWITCH):
        clean_env.delenv(name, raising=False)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "")
    clean_env.setattr(sys, "argv", ["{{ cookiecutter.project_slug }}", "train", *CPU_DEBUG])
    return clean_env


CPU_DEBUG = ["--config", str(RECIPES / "cpu-debug.yaml")]


def test_train_starts_its_other_ranks_early_only_as_the_first_process_of_a_layout_it_launches(
    first_rank: pytest.MonkeyPatch,
) -> None:
    recipe = parse_recipe(CPU_DEBUG, "train")
    assert prestart.should_start_early(recipe, CPU_DEBUG)
    assert not prestart.should_start_early(recipe, [*CPU_DEBUG, "--devices", "2"])  # not this process's command line
    assert not prestart.should_start_early(parse_recipe([*CPU_DEBUG, "--devices", "1"], "train"), CPU_DEBUG)
    for variable, value in (
        ("LOCAL_RANK", "1"),
        ("TORCHELASTIC_RUN_ID", "x"),
        ("SLURM_NTASKS", "2"),
        ("LT_CLI_USED", "1"),
    ):
        with first_rank.context() as launched:  # already a rank of a launcher's: nothing to start
            launched.setenv(variable, value)
            assert not prestart.should_start_early(recipe, CPU_DEBUG), variable
    first_rank.setenv(prestart.SWITCH, "0")
    assert not prestart.should_start_early(recipe, CPU_DEBUG)


def test_a_layout_the_machine_cannot_hold_is_left_to_rank_zeros_refusal_with_nothing_started(
    first_rank: pytest.MonkeyPatch,
) -> None:
    many = str(prestart.cpu_process_limit() + 1)
    assert not prestart.fits_this_machine(parse_recipe([*CPU_DEBUG, "--devices", many], "train"))
    on_gpus = [*CPU_DEBUG, "--accelerator", "cuda", "--strategy.process_group_backend", "nccl", "--devices"]
    first_rank.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert prestart.listed_gpus() == 2
    assert prestart.fits_this_machine(parse_recipe([*on_gpus, "2"], "train"))
    assert not prestart.fits_this_machine(parse_recipe([*on_gpus, "3"], "train"))
    first_rank.setenv("CUDA_VISIBLE_DEVICES", "")
    assert prestart.listed_gpus() == 0
    assert not prestart.fits_this_machine(parse_recipe([*on_gpus, "2"], "train"))
