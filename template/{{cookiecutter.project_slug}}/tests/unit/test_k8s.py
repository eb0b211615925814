"""`k8s`: the PyTorchJob and RayJob a recipe becomes (pods, GPUs, torchrun or `ray`, volume, secret), the
PyTorchJob valid as a whole against Kubeflow's published schema and every pod against Kubernetes'
(tests/k8s_schemas/SOURCE.md), and what it refuses."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import RECIPES
from jsonschema import Draft202012Validator

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.cluster.k8s import job_manifest
from {{ cookiecutter.package_name }}.cluster.launchers import PACKAGE, torchrun_command
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

RECIPE = str(RECIPES / "cpu-debug.yaml")
SCHEMAS = Path(__file__).parents[1] / "k8s_schemas"
POD_TEMPLATE = Draft202012Validator(json.loads((SCHEMAS / "podtemplatespec-v1.37.0.json").read_text()))
PYTORCHJOB = Draft202012Validator(json.loads((SCHEMAS / "pytorchjob-kubeflow-training-1.9.4.json").read_text()))
FOUR_BY_EIGHT = ("--num_nodes", "4", "--devices", "8", "--accelerator", "cuda")


def recipe(*overrides: str) -> Any:
    return parse_recipe(["--config", RECIPE, "--out_dir", "/runs/a", *overrides])


def pod_templates(job: dict[str, Any]) -> dict[str, Any]:
    """Every pod template of a job, by where it sits."""
    if job["kind"] == "PyTorchJob":
        return {name: spec["template"] for name, spec in job["spec"]["pytorchReplicaSpecs"].items()}
    cluster = job["spec"]["rayClusterSpec"]
    groups = {group["groupName"]: group["template"] for group in cluster["workerGroupSpecs"]}
    return {"head": cluster["headGroupSpec"]["template"], **groups}


def schema_errors(job: dict[str, Any]) -> list[str]:
    """What the schemas refuse: the whole PyTorchJob, and every pod of either kind."""
    pods = pod_templates(job).items()
    errors = [f"{name}: {error.message}" for name, pod in pods for error in POD_TEMPLATE.iter_errors(pod)]
    if job["kind"] == "PyTorchJob":
        errors += [f"{'.'.join(map(str, error.path))}: {error.message}" for error in PYTORCHJOB.iter_errors(job)]
    return errors


def test_four_nodes_of_eight_gpus_run_the_launchers_torchrun_command() -> None:
    job = job_manifest("pytorchjob", recipe(*FOUR_BY_EIGHT), RECIPE, "reg/img:1", "runs")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert {spec["restartPolicy"] for spec in replicas.values()} == {"OnFailure"}
    # The command the two-node torchrun test runs (tests/e2e/test_multinode.py), with the operator's rendezvous.
    torchrun = torchrun_command(
        4, 8, "$(RANK)", "$(MASTER_ADDR)", "$(MASTER_PORT)", ["--config", RECIPE, "--checkpoint.resume", "auto"]
    )
    assert torchrun[:12] == [
        "torchrun", "--nnodes", "4", "--nproc-per-node", "8", "--node-rank", "$(RANK)",
        "--master-addr", "$(MASTER_ADDR)", "--master-port", "$(MASTER_PORT)", "-m",
    ]  # fmt: skip
    for pod in pod_templates(job).values():
        (container,) = pod["spec"]["containers"]
        assert container["command"] == torchrun
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        key = next(env for env in container["env"] if env["name"] == "WANDB_API_KEY")
        assert key["valueFrom"]["secretKeyRef"]["name"] == "wandb" and "value" not in key
        assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
        assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}} in pod["spec"]["volumes"]


def test_one_cpu_node_has_no_workers_and_no_gpus() -> None:
    job = job_manifest("pytorchjob", recipe("--accelerator", "cpu"), RECIPE, "img", "runs")
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert "resources" not in pod_templates(job)["Master"]["spec"]["containers"][0]


def test_rayjob_runs_ray_on_the_head_and_gives_each_node_pod_its_gpus() -> None:
    out_dir = "/runs/a b; echo 'x'"  # a shell would split and run this unquoted
    job = job_manifest("rayjob", recipe(*FOUR_BY_EIGHT, "--out_dir", out_dir), RECIPE, "img", "runs",
                       overrides=["--out_dir", out_dir])  # fmt: skip
    spec = job["spec"]
    assert shlex.split(spec["entrypoint"]) == [
        "python", "-m", PACKAGE, "ray", RECIPE, "--out_dir", out_dir, "--checkpoint.resume", "auto",
    ]  # fmt: skip
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 4
    pods = pod_templates(job)
    assert pods["nodes"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "resources" not in pods["head"]["spec"]["containers"][0]  # the driver needs no GPU
    for pod in pods.values():
        names = [env["name"] for env in pod["spec"]["containers"][0]["env"]]
        assert "WANDB_API_KEY" in names
        assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}} in pod["spec"]["volumes"]


@pytest.mark.parametrize("kind", ["pytorchjob", "rayjob"])
@pytest.mark.parametrize("layout", [("--accelerator", "cpu"), FOUR_BY_EIGHT], ids=["1-cpu-node", "4x8-gpus"])
def test_the_job_and_its_pods_are_valid_against_the_published_schemas(kind: str, layout: tuple[str, ...]) -> None:
    assert schema_errors(job_manifest(kind, recipe(*layout), RECIPE, "img", "runs")) == []


@pytest.mark.parametrize(
    ("break_pod", "message"),
    [
        (lambda container: container.pop("name"), "'name' is a required property"),
        (lambda container: container.update(env={"WANDB_API_KEY": "x"}), "is not of type 'array'"),
        (lambda container: container.update(volumeMount=[]), "Additional properties are not allowed"),
    ],
    ids=["missing-required", "wrong-type", "unknown-field"],
)
def test_the_schema_refuses_a_broken_pod(break_pod: Any, message: str) -> None:
    job = copy.deepcopy(job_manifest("pytorchjob", recipe(), RECIPE, "img", "runs"))
    break_pod(pod_templates(job)["Master"]["spec"]["containers"][0])
    assert any(message in error for error in schema_errors(job)), schema_errors(job)


@pytest.mark.parametrize(
    ("break_job", "message"),
    [
        (lambda spec: spec.pop("runPolicy"), "'runPolicy' is a required property"),
        (lambda spec: spec["pytorchReplicaSpecs"]["Master"].update(replicas="1"), "'1' is not of type 'integer'"),
        (lambda spec: spec["runPolicy"].update(backofLimit=3), "('backofLimit' was unexpected)"),
    ],
    ids=["missing-required", "wrong-type", "unknown-field"],
)
def test_the_schema_refuses_a_broken_pytorchjob(break_job: Any, message: str) -> None:
    job = copy.deepcopy(job_manifest("pytorchjob", recipe(*FOUR_BY_EIGHT), RECIPE, "img", "runs"))
    break_job(job["spec"])
    assert any(message in error for error in schema_errors(job)), schema_errors(job)


@pytest.mark.parametrize(
    ("kind", "image", "pvc", "overrides", "field"),
    [
        ("pytorchjob", None, "runs", [], "--image"),
        ("rayjob", "img; rm -rf /", "runs", [], "--image"),
        ("pytorchjob", "img", "Bad_Name", [], "--pvc"),
        ("pytorchjob", "img", "runs", ["--out_dir", "out/a"], "out_dir"),
        ("pytorchjob", "img", "runs", ["--out_dir", "/runs/../etc/cron.d"], "is not on the volume"),
        ("tfjob", "img", "runs", [], "--kind"),
        ("rayjob", "img", "runs", ["--out_dir", "/runs/$(HOME)"], r"has '\$'"),
        ("rayjob", "img", "runs", ["--accelerator", "cpu", "--num_nodes", "2"], "cannot keep devices=2 per node"),
    ],
)
def test_refuses(kind: str, image: str | None, pvc: str, overrides: list[str], field: str) -> None:
    with pytest.raises(RecipeError, match=field):
        job_manifest(kind, recipe(*overrides), RECIPE, image, pvc, overrides=overrides)


@pytest.mark.parametrize("kind", ["pytorchjob", "rayjob"])
def test_command_writes_the_manifest(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "job.yaml"
    main(["k8s", "cpu-debug", "--kind", kind, "--image", "img", "--pvc", "runs", "--out", str(out), "--out_dir", "/runs/a"])  # fmt: skip
    text = out.read_text()
    assert yaml.safe_load(text)["kind"] == {"pytorchjob": "PyTorchJob", "rayjob": "RayJob"}[kind]
    # Pods share their volumes and env: each is written out in full, no anchor or alias for tools that do not
    # expand them (several nodes, so that more than one pod holds them).
    many = tmp_path / "many.yaml"
    main(["k8s", "cpu-debug", "--kind", kind, "--image", "img", "--pvc", "runs", "--out", str(many), "--out_dir", "/runs/a", "--num_nodes", "4", "--devices", "8", "--accelerator", "cuda"])  # fmt: skip
    assert not re.search(r"[&*]id\d", text + many.read_text()), many.read_text()


def test_a_library_recipe_is_named_by_its_place_in_the_project_not_this_machines_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # anywhere but the project folder
    out = tmp_path / "job.yaml"
    main(["k8s", "cpu-debug", "--image", "img", "--pvc", "runs", "--out", str(out), "--out_dir", "/runs/a"])
    text = out.read_text()
    assert "recipes/cpu-debug.yaml" in text and str(RECIPES) not in text


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--image", "img", "--pvc", "runs"], "out_dir"),  # cpu-debug writes under runs/, off the volume
        (["--image", "img", "--pvc", "runs", "--out_dir", "/runs/a", "--accelerator", "cpu", "--precision", "16-true"],
         "precision=16-true needs a GPU"),
        (["--image", "a b", "--pvc", "runs", "--out_dir", "/runs/a", "--kind", "rayjob"], "--image"),
    ],
    ids=["off-the-volume", "gpu-needed", "bad-image"],
)  # fmt: skip
def test_command_refuses_in_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], field: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["k8s", "cpu-debug", *args, "--out", str(tmp_path / "no.yaml")])
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(error.splitlines()) == 1 and field in error, error
    assert not (tmp_path / "no.yaml").exists()
