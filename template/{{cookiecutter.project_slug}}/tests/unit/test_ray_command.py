"""`ray`: what it refuses, in one line with exit code 2, before a Ray cluster is joined or started; and the Ray
Train worker's ranks and placement as Fabric and the launcher check see them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import RECIPES, fail_with, free_port, run_cli_without

from {{ cookiecutter.package_name }}.cluster.launchers import RAY_WORKER, check_launcher
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

ray = pytest.importorskip("ray")


def test_a_bad_recipe_is_refused_in_one_line_before_ray_or_torch_is_imported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: 0\n")
    result = run_cli_without(("ray", "torch"), "ray", str(bad), "--out_dir", str(tmp_path / "run"))
    assert (result.returncode, result.stderr) == (2, "error: recipe 'bad.yaml': devices=0 must be >= 1\n")
    assert not (tmp_path / "run").exists()


def test_without_ray_the_command_says_how_to_install_it(tmp_path: Path) -> None:
    result = run_cli_without(("ray",), "ray", "cpu-debug", "--out_dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr == "error: ray needs Ray Train, which is not installed here: pip install '{{ cookiecutter.project_slug }}[ray]'\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--max_failures", "-2"], "--max_failures=-2 must be >= -1 (-1: restart without limit)"),
        (["--max_failures", "many"], "max_failures"),
        (["--address", " "], "--address is empty"),
        (["--checkpoint.max_failures", "-5"], "checkpoint.max_failures=-5 must be >= -1"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_bad_flags_are_refused_in_one_line(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in fail_with(["ray", "cpu-debug", "--out_dir", str(tmp_path / "run"), *arguments], capsys)
    assert not (tmp_path / "run").exists() and not ray.is_initialized()


def test_an_address_where_no_cluster_answers_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    error = fail_with(["ray", "cpu-debug", "--address", address, "--out_dir", str(tmp_path / "run")], capsys)
    assert error.startswith(f"error: --address {address}: no Ray cluster answers at {address} (")
    assert time.monotonic() - started < 30 and not ray.is_initialized()  # ray.init would wait for minutes
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "resources", "started_here", "message"),
    [
        (["--accelerator", "cuda"], {"CPU": 64.0}, False, "accelerator=cuda but the Ray cluster has no GPU"),
        (["--accelerator", "auto", "--strategy.name", "ddp", "--precision", "16-mixed"], {"CPU": 64.0}, False,
         "the Ray cluster has no GPU: precision=16-mixed needs a GPU"),
        (["--devices", "4"], {"CPU": 2.0}, True,
         "devices=4 x num_nodes=1 = 4 workers of one CPU each, but this machine's local Ray cluster has 2 CPU(s)"),
    ],
    ids=["cuda without GPUs", "a GPU precision without GPUs", "more workers than local CPUs"],
)  # fmt: skip
def test_a_layout_the_cluster_cannot_hold_is_refused(
    overrides: list[str],
    resources: dict[str, float],
    started_here: bool,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from {{ cookiecutter.package_name }}.cluster.ray import placed_recipe

    monkeypatch.setattr(ray, "cluster_resources", lambda: resources)  # the cluster's resources, as Ray tells them
    recipe = parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), *overrides])
    with pytest.raises(RecipeError) as refused:
        placed_recipe(recipe, started_here)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_auto_takes_the_clusters_gpus_and_cpu_where_it_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from {{ cookiecutter.package_name }}.cluster.ray import placed_recipe

    recipe = parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), "--accelerator", "auto"])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert placed_recipe(recipe, started_here=False).accelerator == "cuda"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert placed_recipe(recipe, started_here=False).accelerator == "cpu"


def test_in_a_ray_worker_fabric_takes_rays_ranks_and_a_placement_other_than_the_recipes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from {{ cookiecutter.package_name }}.cluster.ray_worker import RayTrainEnvironment

    # What Ray Train gives the second worker of a 2 nodes x 2 workers group; KUBERNETES_PORT as on KubeRay, where
    # Fabric would otherwise detect a Kubeflow job (whose local rank is always 0).
    ranks = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}
    for name, value in {**ranks, RAY_WORKER: "1", "KUBERNETES_PORT": "tcp://10.0.0.1:443"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    environment = RayTrainEnvironment()
    assert environment.creates_processes_externally and not RayTrainEnvironment.detect()
    seen = (environment.global_rank(), environment.world_size(), environment.local_rank(), environment.node_rank())
    assert seen == (3, 4, 1, 1)
    two_by_two = parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), "--num_nodes", "2"])
    check_launcher(two_by_two, "cpu")
    with pytest.raises(RecipeError, match=r"^Ray placed 2 of the 4 workers on this node, but the recipe asks for"):
        check_launcher(parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), "--devices", "4"]), "cpu")
    monkeypatch.setenv("SLURM_NTASKS", "8")  # a Ray cluster inside a SLURM allocation: Ray's ranks still count
    monkeypatch.setenv("SLURM_JOB_NAME", "ray-head")
    check_launcher(two_by_two, "cpu")


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [([], 3), (["--checkpoint.max_failures", "5"], 5), (["--max_failures", "0", "--checkpoint.max_failures", "5"], 0)],
    ids=["the recipe's default", "the recipe's", "the flag over the recipe's"],
)
def test_max_failures_comes_from_the_flag_else_the_recipe_and_the_run_resumes_automatically(
    arguments: list[str], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from {{ cookiecutter.package_name }}.cli import main
    from {{ cookiecutter.package_name }}.cluster import ray as ray_launcher

    handed: list[tuple[str | None, int, str | None]] = []
    monkeypatch.setattr(  # what the command hands to Ray's side, which is run for real in tests/e2e/test_ray.py
        ray_launcher,
        "train_with_ray",
        lambda recipe, address, failures, train: handed.append((address, failures, recipe.checkpoint.resume)),
    )
    main(["ray", "cpu-debug", "--address", "head:6379", *arguments])
    assert handed == [("head:6379", expected, "auto")]
