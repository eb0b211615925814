"""`k8s`: the PyTorchJob a recipe becomes (pods, GPUs, torchrun, volume, secret) and what it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import RECIPES

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.cluster.k8s import pytorchjob
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

RECIPE = str(RECIPES / "cpu-debug.yaml")


def recipe(*overrides: str) -> Any:
    return parse_recipe(["--config", RECIPE, "--out_dir", "/runs/a", *overrides])


def pod(job: dict[str, Any], replica: str) -> Any:
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]


def test_four_nodes_of_eight_gpus() -> None:
    job = pytorchjob(recipe("--num_nodes", "4", "--devices", "8", "--accelerator", "cuda"), RECIPE, "reg/img:1", "runs")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert {spec["restartPolicy"] for spec in replicas.values()} == {"OnFailure"}
    for name in ("Master", "Worker"):
        (container,) = pod(job, name)["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        command = container["command"]
        assert command[:12] == [
            "torchrun", "--nnodes", "4", "--nproc-per-node", "8", "--node-rank", "$(RANK)",
            "--master-addr", "$(MASTER_ADDR)", "--master-port", "$(MASTER_PORT)", "-m",
        ]  # fmt: skip
        assert command[-2:] == ["--checkpoint.resume", "auto"]
        key = next(env for env in container["env"] if env["name"] == "WANDB_API_KEY")
        assert key["valueFrom"]["secretKeyRef"]["name"] == "wandb" and "value" not in key
        assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
    volumes = pod(job, "Master")["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}} in volumes
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in volumes


def test_one_cpu_node_has_no_workers_and_no_gpus() -> None:
    job = pytorchjob(recipe("--accelerator", "cpu"), RECIPE, "img", "runs")
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert "resources" not in pod(job, "Master")["containers"][0]


@pytest.mark.parametrize(
    ("image", "pvc", "out_dir", "field"),
    [
        (None, "runs", "/runs/a", "--image"),
        ("img", "Bad_Name", "/runs/a", "--pvc"),
        ("img", "runs", "out/a", "out_dir"),
    ],
)
def test_refuses(image: str | None, pvc: str, out_dir: str, field: str) -> None:
    with pytest.raises(RecipeError, match=field):
        pytorchjob(recipe("--out_dir", out_dir), RECIPE, image, pvc)


def test_command_writes_yaml_and_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.yaml"
    args = ["k8s", "cpu-debug", "--image", "img", "--pvc", "runs"]
    main([*args, "--out", str(out), "--out_dir", "/runs/a"])
    assert yaml.safe_load(out.read_text())["kind"] == "PyTorchJob"
    with pytest.raises(SystemExit) as exited:
        main([*args, "--out", str(tmp_path / "no.yaml")])
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(error.splitlines()) == 1 and "out_dir" in error
    assert not (tmp_path / "no.yaml").exists()
