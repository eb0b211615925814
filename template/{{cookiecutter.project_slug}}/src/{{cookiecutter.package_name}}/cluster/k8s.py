"""Kubernetes jobs: `<project> k8s RECIPE --image IMAGE --pvc NAME` writes a Kubeflow PyTorchJob, or with
`--kind rayjob` a KubeRay RayJob, for the recipe's nodes x devices.

PyTorchJob (kubeflow.org/v1): one pod per node (Master 1, Worker nodes-1), the recipe's GPUs per pod,
in every pod the torchrun command the launcher tests run (cluster/launchers.py) with the rendezvous
the operator sets (MASTER_ADDR, MASTER_PORT, RANK = the node rank); a failed pod restarts and resumes
from the newest complete checkpoint (checkpoint.resume auto).
RayJob (ray.io/v1): a Ray cluster of a head pod, which runs `<package> ray RECIPE` (the driver, no
GPUs), and one worker pod per node with the recipe's GPUs, where Ray Train places the training
workers; a failed job is submitted again on a new cluster and resumes the same way.
Both: out_dir on a PersistentVolumeClaim mounted in every pod, the W&B key from a Secret, /dev/shm in
memory. Values are serialised by a YAML dumper, never pasted into text; the one shell command line
(the RayJob's entrypoint) quotes every word.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

import yaml

from ..errors import RecipeError
from ..project import PROJECT
from ..recipe.schema import CheckpointConfig, Recipe, field_path
from .jobs import gpus_per_node, shown
from .launchers import PACKAGE, torchrun_command

KINDS = ("pytorchjob", "rayjob")
MOUNT = "/runs"
# RFC 1123 DNS label (PVC, Secret and job names): lower-case letters, digits and '-', at most 63.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# An image reference: [registry[:port]/]path[:tag][@digest]; no spaces, quotes or shell characters.
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")


def check_name(flag: str, value: str) -> None:
    """Refuse a name Kubernetes would not take (RFC 1123 label)."""
    if not DNS_LABEL.fullmatch(value):
        raise RecipeError(
            f"--{flag}={shown(value)} is not a Kubernetes name: use lower-case letters, digits and '-'"
            " (starting and ending with a letter or digit, at most 63)"
        )


def check_words(words: list[str]) -> None:
    """Refuse a recipe path or override that a container command cannot carry as it is: a control character,
    or '$', which Kubernetes expands in commands ($(NAME)) before any shell sees it."""
    for word in words:
        if "$" in word or any(ord(char) < 32 or ord(char) == 127 for char in word):
            raise RecipeError(
                f"{shown(word)} has '$' or a control character, which a pod's command would not pass on as"
                " written: rename the file or change the value"
            )


def check_job(
    kind: str, recipe: Recipe, image: str | None, pvc: str | None, names: dict[str, str], backoff_limit: int
) -> None:
    """Every refusal of `k8s`, before anything is written: the kind, the image, the names, the volume."""
    if kind not in KINDS:
        raise RecipeError(f"--kind={shown(kind)} is not a job kind: choose {' or '.join(KINDS)}")
    if not image:
        raise RecipeError("--image is required: the container image that holds this project")
    if not IMAGE.fullmatch(image):
        raise RecipeError(
            f"--image={shown(image)} is not an image reference: letters, digits and . _ / : @ -"
            " (e.g. registry.example/team/project:1)"
        )
    if pvc is None:
        raise RecipeError(f"--pvc is required: the PersistentVolumeClaim that holds out_dir (mounted at {MOUNT})")
    for flag, value in {"pvc": pvc, **names}.items():
        check_name(flag, value)
    if backoff_limit < 0:
        raise RecipeError(f"--backoff_limit={backoff_limit} must be >= 0")
    out_dir = PurePosixPath(str(recipe.out_dir))
    # The pod's path, resolved as the pod resolves it (`..` collapsed), not compared as text: /runs/../etc is /etc.
    resolved = PurePosixPath(posixpath.normpath(str(out_dir)))
    if not out_dir.is_absolute() or not resolved.is_relative_to(MOUNT):
        raise RecipeError(
            f"out_dir={shown(str(out_dir))} is not on the volume: set out_dir under {MOUNT}/ (e.g. {MOUNT}/run1)"
        )


def pod_template(
    container: str, image: str, gpus: int, pvc: str, wandb_secret: str, command: list[str] | None = None
) -> dict[str, Any]:
    """A pod of the job: one container (running `command`, else the image's own) with `gpus` GPUs, the run
    volume, the W&B key and a memory /dev/shm."""
    spec: dict[str, Any] = {"name": container, "image": image, **({"command": command} if command else {})}
    spec["env"] = [
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
        {
            "name": "WANDB_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": wandb_secret, "key": "api-key", "optional": True}},
        },
    ]
    spec["volumeMounts"] = [{"name": "runs", "mountPath": MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if gpus:
        spec["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    return {"spec": {"containers": [spec], "volumes": volumes}}


def job_manifest(
    kind: str,
    recipe: Recipe,
    recipe_path: str,
    image: str | None,
    pvc: str | None,
    job_name: str = PROJECT,
    wandb_secret: str = "wandb",
    backoff_limit: int = 10,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """The job of `kind` (pytorchjob or rayjob) that trains `recipe_path`; refuses what it cannot express."""
    check_job(kind, recipe, image, pvc, {"job_name": job_name, "wandb_secret": wandb_secret}, backoff_limit)
    assert image is not None and pvc is not None  # checked above
    arguments = ["--config", recipe_path, *(overrides or []), f"--{field_path(CheckpointConfig, 'resume')}", "auto"]
    check_words(arguments)
    gpus = gpus_per_node(recipe)
    metadata = {"name": job_name}
    if kind == "rayjob" and not gpus and recipe.num_nodes > 1:
        # GPUs pin Ray Train's workers: a pod with D GPUs takes exactly D of them. CPUs do not: Ray places
        # CPU workers wherever CPUs are free, so D per pod on N pods is not kept.
        raise RecipeError(
            f"--kind rayjob cannot keep devices={recipe.devices} per node on num_nodes={recipe.num_nodes} CPU"
            " pods (Ray places CPU workers wherever CPUs are free): use --kind pytorchjob, or num_nodes 1"
        )
    if kind == "rayjob":
        spec = rayjob_spec(recipe, arguments[1:], image, gpus, pvc, wandb_secret, backoff_limit)
        return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": metadata, "spec": spec}
    torchrun = torchrun_command(
        recipe.num_nodes, recipe.devices, "$(RANK)", "$(MASTER_ADDR)", "$(MASTER_PORT)", arguments
    )
    # PyTorchJob finds its container by the name "pytorch" and sets RANK, MASTER_ADDR, MASTER_PORT in each pod.
    replicas = {
        role: {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": pod_template("pytorch", image, gpus, pvc, wandb_secret, torchrun),
        }
        for role, count in (("Master", 1), ("Worker", recipe.num_nodes - 1))
        if count
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {"runPolicy": {"backoffLimit": backoff_limit}, "pytorchReplicaSpecs": replicas},
    }


def rayjob_spec(
    recipe: Recipe, ray_args: list[str], image: str, gpus: int, pvc: str, wandb_secret: str, backoff_limit: int
) -> dict[str, Any]:
    """A RayJob's spec: the driver `<package> ray RECIPE` on the head, one worker pod per node with its GPUs."""
    worker = pod_template("ray-worker", image, gpus, pvc, wandb_secret)
    return {
        # A shell command line (KubeRay hands it to `ray job submit`): every word quoted.
        "entrypoint": shlex.join(["python", "-m", PACKAGE, "ray", *ray_args]),
        "shutdownAfterJobFinishes": True,
        "backoffLimit": backoff_limit,
        "rayClusterSpec": {
            "headGroupSpec": {
                # No CPUs offered to Ray on the head: every training worker lands on a node pod.
                "rayStartParams": {"num-cpus": "0"},
                "template": pod_template("ray-head", image, 0, pvc, wandb_secret),
            },
            "workerGroupSpecs": [
                {
                    "groupName": "nodes",
                    "replicas": recipe.num_nodes,
                    "minReplicas": recipe.num_nodes,
                    "maxReplicas": recipe.num_nodes,
                    "rayStartParams": {},
                    "template": worker,
                }
            ],
        },
    }


class NoAliasDumper(yaml.SafeDumper):
    """The safe dumper, writing a value shared by several pods (their volumes, the Secret's env) out in full each
    time: some Kubernetes tooling does not expand YAML anchors and aliases (&id001 / *id001)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def manifest_text(job: dict[str, Any]) -> str:
    """The manifest as YAML (safe dumper: every value quoted as it needs, no anchors or aliases)."""
    return yaml.dump(job, Dumper=NoAliasDumper, sort_keys=False)
