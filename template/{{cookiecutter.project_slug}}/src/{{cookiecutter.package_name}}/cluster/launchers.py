"""The launchers a job starts under, and the rule that the recipe decides the layout.

A job starts from Fabric itself (`<project> train`: `fabric.launch()` spawns `devices` processes),
from `fabric run`, from torchrun (static or c10d rendezvous, elastic restarts), from srun or in Ray
Train's workers (`<project> ray`: cluster/ray.py). The
recipe is the one source of truth for the layout and strategy: a launcher that starts another
number of processes, or whose `fabric run --devices/--num-nodes/--accelerator/--strategy/--precision`
flag differs from the recipe, is refused with one line naming both values (exit code 2).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import RecipeError
from ..recipe.schema import Recipe, StrategyConfig, field_path
from .lifecycle import mark_launcher

if TYPE_CHECKING:  # this module is imported by commands that only write job files: no torch at the top
    from lightning.fabric import Fabric

PACKAGE = __name__.partition(".")[0]  # this package's name: launchers run it with -m

# `fabric run` exports its flags as LT_* variables for Fabric(...) to compare with its own arguments.
FABRIC_RUN_FLAGS = ("devices", "num_nodes", "accelerator", "strategy", "precision")
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
RAY_WORKER = "TRAIN_RAY_WORKER"  # set by cluster/ray.py in the Ray Train workers it trains in


def torchrun_command(
    nodes: int,
    devices: int,
    node_rank: str,
    master_addr: str,
    master_port: str,
    train_args: Sequence[str],
    torchrun: Sequence[str] = ("torchrun",),
) -> list[str]:
    """torchrun with a static rendezvous: `devices` processes on each of `nodes` nodes, each `<package> train
    train_args`. The one builder of this command: `k8s` writes it into every pod, the launcher tests run it."""
    return [
        *torchrun,
        "--nnodes", str(nodes),
        "--nproc-per-node", str(devices),
        "--node-rank", node_rank,
        "--master-addr", master_addr,
        "--master-port", master_port,
        "-m", PACKAGE, "train", *train_args,
    ]  # fmt: skip


def launched_by_fabric_run() -> bool:
    """Whether `fabric run` started this process (it has then made the processes: no `fabric.launch()`)."""
    return os.environ.get("LT_CLI_USED") == "1"


def launched_by_ray() -> bool:
    """Whether this process is a Ray Train worker of `<project> ray` (Ray made the processes and the process group)."""
    return os.environ.get(RAY_WORKER) == "1"


def launcher_name() -> str:
    """Which launcher started this process, as a run's provenance records it: ray, k8s (torchrun in its pods),
    fabric run, torchrun, slurm, or local (`<project> train` launching its own processes)."""
    if launched_by_ray():
        return "ray"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if "KUBERNETES_SERVICE_HOST" in os.environ:  # set in every Kubernetes pod
            return "k8s"
        return "fabric run" if launched_by_fabric_run() else "torchrun"
    if slurm_detected():
        return "slurm"
    return "fabric run" if launched_by_fabric_run() else "local"


def start_processes(fabric: Fabric) -> None:
    """Launch the processes the recipe asks for, unless a launcher already did (or `train` started them early and
    released them: cluster/prestart.py)."""
    if not launched_by_fabric_run():
        mark_launcher()  # the ranks it starts die with it (cluster/lifecycle.py)
        fabric.launch()


def check_launcher(recipe: Recipe, accelerator: str) -> None:
    """Refuse a launcher whose layout or flags differ from the recipe's (`accelerator`: the resolved one)."""
    if launched_by_fabric_run():
        _check_fabric_run(recipe, accelerator)
    if launched_by_ray():  # before SLURM's: a Ray cluster may run inside a SLURM allocation
        _check_ray_placement(recipe)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun, and `fabric run`, which calls it
        _check_torchrun_restarts()
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if (world, local) != (recipe.world_size, recipe.devices):
            raise RecipeError(
                f"torchrun started {world} process(es), {local} per node, but the recipe asks for"
                f" devices={recipe.devices} x num_nodes={recipe.num_nodes} = {recipe.world_size}: match"
                f" --nproc-per-node/--nnodes to the recipe, or override it with --devices {local}"
                f" --num_nodes {max(1, world // max(local, 1))}"
            )
    elif slurm_detected():
        tasks = int(os.environ["SLURM_NTASKS"])
        if tasks != recipe.world_size:
            raise RecipeError(
                f"srun started {tasks} task(s) but the recipe asks for devices={recipe.devices} x"
                f" num_nodes={recipe.num_nodes} = {recipe.world_size}: match --nodes/--ntasks-per-node to the"
                " recipe, or override it with --devices and --num_nodes"
            )


def slurm_detected() -> bool:
    """Whether srun started this process (Lightning's own test, imported here: it loads torch)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def _check_ray_placement(recipe: Recipe) -> None:
    """Ray places workers where it finds room: refuse a group that is not devices workers on each of num_nodes nodes
    (Fabric's device of a worker is its LOCAL_RANK among `devices`)."""
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if (world, local) != (recipe.world_size, recipe.devices):
        raise RecipeError(
            f"Ray placed {local} of the {world} workers on this node, but the recipe asks for devices="
            f"{recipe.devices} on each of num_nodes={recipe.num_nodes}: give each node exactly devices GPUs"
            " (or CPUs) free for this run, or change the recipe's layout"
        )


def _check_torchrun_restarts() -> None:
    """Refuse torchrun restarts through the agent's shared store: a restarted round can read the failed
    round's addresses from it, and nodes need not agree on the restart count (pytorch issues 108158,
    135712), so the new round can fail to connect or hang. torch's own switch gives each round its
    own store; it is only honoured by the c10d rendezvous (the static one always shares its store)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RecipeError(
            f"torchrun --max-restarts {restarts} with a rendezvous store shared by the workers: start torchrun with"
            " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and --rdzv-backend c10d, so that a restarted"
            " round cannot read the failed round's addresses"
        )


def _check_fabric_run(recipe: Recipe, accelerator: str) -> None:
    """`fabric run` flags must equal the recipe's values; once checked they are cleared so Fabric uses the recipe's."""
    wanted = {
        "devices": str(recipe.devices),
        "num_nodes": str(recipe.num_nodes),
        "accelerator": accelerator,
        "strategy": recipe.strategy.name,
        "precision": recipe.precision,
    }
    for flag in FABRIC_RUN_FLAGS:
        given = os.environ.get(f"LT_{flag.upper()}")
        if given is not None and _normalized(flag, given) != wanted[flag]:
            option = flag.replace("_", "-")
            key = field_path(StrategyConfig, "name") if flag == "strategy" else flag
            raise RecipeError(
                f"fabric run --{option}={given} conflicts with the recipe's {key}={wanted[flag]} (the recipe"
                f" decides: pass --{option} {wanted[flag]} to fabric run, or omit it, or change the recipe)"
            )
    for flag in FABRIC_RUN_FLAGS:
        os.environ.pop(f"LT_{flag.upper()}", None)


def _normalized(flag: str, value: str) -> str:
    """A `fabric run` flag value in the recipe's terms: `--devices 0,1` is 2, `gpu` is cuda, `bf16` is bf16-mixed."""
    if flag == "devices" and "," in value:
        return str(len([index for index in value.split(",") if index.strip()]))
    if flag == "accelerator" and value == "gpu":
        return "cuda"
    if flag == "precision":
        return PRECISION_ALIASES.get(value, value)
    return value
