"""Kubernetes jobs: `<project> k8s RECIPE --image IMAGE --pvc NAME` writes a Kubeflow PyTorchJob manifest.

One pod per node (Master 1, Worker nodes-1), the recipe's GPUs per pod, torchrun in every pod with the
rendezvous PyTorchJob sets (MASTER_ADDR, MASTER_PORT, RANK = the node rank), restarts on failure that
resume from the newest complete checkpoint (checkpoint.resume auto), out_dir on a PersistentVolumeClaim
mounted in every pod, the W&B key from a Secret and /dev/shm in memory. Values are serialised by a YAML
dumper, never pasted into text.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

import yaml

from {{ cookiecutter.package_name }}.cluster.slurm import gpus_per_node, shown
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.schema import Recipe

PACKAGE = "{{ cookiecutter.package_name }}"
MOUNT = "/runs"
# RFC 1123 DNS label (PVC, Secret and job names): lower-case letters, digits and '-', at most 63.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def torchrun_command(
    nodes: int, devices: int, recipe_path: str, node_rank: str, master_addr: str, master_port: str
) -> list[str]:
    """torchrun with a static rendezvous: `nodes` x `devices` processes training `recipe_path`."""
    return [
        "torchrun",
        "--nnodes", str(nodes),
        "--nproc-per-node", str(devices),
        "--node-rank", node_rank,
        "--master-addr", master_addr,
        "--master-port", master_port,
        "-m", PACKAGE, "train", "--config", recipe_path,
    ]  # fmt: skip


def check_name(flag: str, value: str) -> None:
    """Refuse a name Kubernetes would not take (RFC 1123 label)."""
    if not DNS_LABEL.fullmatch(value):
        raise RecipeError(
            f"--{flag}={shown(value)} is not a Kubernetes name: use lower-case letters, digits and '-'"
            " (starting and ending with a letter or digit, at most 63)"
        )


def pytorchjob(
    recipe: Recipe,
    recipe_path: str,
    image: str | None,
    pvc: str | None,
    job_name: str = "{{ cookiecutter.project_slug }}",
    wandb_secret: str = "wandb",
    backoff_limit: int = 10,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """The PyTorchJob (kubeflow.org/v1) that trains `recipe_path` on the recipe's nodes x devices."""
    if not image:
        raise RecipeError("--image is required: the container image that holds this project")
    if any(ord(char) < 33 for char in image):
        raise RecipeError(f"--image={shown(image)} has spaces or control characters")
    if pvc is None:
        raise RecipeError("--pvc is required: the PersistentVolumeClaim that holds out_dir (mounted at /runs)")
    for flag, value in (("pvc", pvc), ("job_name", job_name), ("wandb_secret", wandb_secret)):
        check_name(flag, value)
    if backoff_limit < 0:
        raise RecipeError(f"--backoff_limit={backoff_limit} must be >= 0")
    out_dir = PurePosixPath(str(recipe.out_dir))
    if not out_dir.is_absolute() or not out_dir.is_relative_to(MOUNT):
        raise RecipeError(
            f"out_dir={shown(str(out_dir))} is not on the volume: set out_dir under {MOUNT}/ (e.g. {MOUNT}/run1)"
        )
    gpus = gpus_per_node(recipe)
    command = torchrun_command(
        recipe.num_nodes, recipe.devices, recipe_path, "$(RANK)", "$(MASTER_ADDR)", "$(MASTER_PORT)"
    )
    command += [*(overrides or []), "--checkpoint.resume", "auto"]
    container: dict[str, Any] = {
        "name": "pytorch",  # PyTorchJob finds its container by this name
        "image": image,
        "command": command,
        "env": [
            {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
            {
                "name": "WANDB_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": wandb_secret, "key": "api-key", "optional": True}},
            },
        ],
        "volumeMounts": [{"name": "runs", "mountPath": MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    template = {
        "spec": {
            "containers": [container],
            "volumes": [
                {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        }
    }
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if recipe.num_nodes > 1:
        replicas["Worker"] = {"replicas": recipe.num_nodes - 1, "restartPolicy": "OnFailure", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name},
        "spec": {"runPolicy": {"backoffLimit": backoff_limit}, "pytorchReplicaSpecs": replicas},
    }


def manifest_text(job: dict[str, Any]) -> str:
    """The manifest as YAML (safe dumper: every value quoted as it needs)."""
    return yaml.safe_dump(job, sort_keys=False)
