"""`<project> k8s RECIPE --image IMAGE --pvc NAME > job.yaml`: print a Kubeflow PyTorchJob or, with `--kind rayjob`,
a KubeRay RayJob (cluster/k8s.py)."""

from __future__ import annotations

import os
from pathlib import Path

from jsonargparse import ArgumentParser

from ..cluster.k8s import KINDS, MOUNT, job_manifest, manifest_text
from ..project import PROJECT
from ..recipe.library import find_recipe
from ..recipe.load import parse_recipe, split_command_line
from . import parse_arguments

K8S_FLAGS = ("--kind", "--image", "--pvc", "--job_name", "--wandb_secret", "--backoff_limit", "--out")
HELP = f"Write a Kubernetes job: {PROJECT} k8s RECIPE --image IMAGE --pvc NAME > job.yaml."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`k8s`'s arguments: the recipe, the job's kind, the image, the volume and the job's names."""
    parser.description = (
        "Print a Kubeflow PyTorchJob (torchrun in one pod per node) or a KubeRay RayJob (`ray` on a Ray cluster"
        " of one worker pod per node) for a recipe: its GPUs per pod, out_dir on a volume."
    )
    parser.add_argument("recipe", help="Recipe name or path (as the image sees it, relative to its working folder).")
    parser.add_argument("--kind", default="pytorchjob", help=f"Job kind: {' or '.join(KINDS)}.")
    parser.add_argument("--image", default=None, help="Container image that holds this project.")
    parser.add_argument(
        "--pvc", default=None, help=f"PersistentVolumeClaim mounted at {MOUNT} (out_dir must be under it)."
    )
    parser.add_argument("--job_name", default=prog, help="Job name.")
    parser.add_argument("--wandb_secret", default="wandb", help="Secret whose key api-key holds the W&B key.")
    parser.add_argument("--out", default=None, help="Write the manifest to this file instead of printing it.")
    parser.add_argument("--backoff_limit", type=int, default=10, help="Restarts before the job fails.")


def run(argv: list[str], prog: str) -> None:
    """Print (or --out) the job for a recipe; its counts come from the recipe and its overrides."""
    name, own, overrides = split_command_line(argv, K8S_FLAGS)
    args = parse_arguments(prog, "k8s", add_arguments, [*own] + ([name] if name else []))
    path = find_recipe(args.recipe)
    recipe = parse_recipe(["--config", str(path), *overrides], f"{prog} k8s")
    if Path(args.recipe).is_file():
        # Relative to the project folder (the image's working folder): the job finds it on any copy of the project.
        relative = os.path.relpath(path.resolve())
        recipe_path = str(path.resolve()) if relative.startswith("..") else relative
    else:  # a library recipe: where every copy of the project holds it, never where this machine's checkout is
        recipe_path = f"recipes/{path.name}"
    job = job_manifest(
        args.kind,
        recipe,
        recipe_path,
        args.image,
        args.pvc,
        args.job_name,
        args.wandb_secret,
        args.backoff_limit,
        overrides,
    )
    text = manifest_text(job)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
