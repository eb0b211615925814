"""The Ray Train side of `<project> ray RECIPE` (commands/ray.py parses and checks it): the project's own `train`
runs in the workers of Ray Train's TorchTrainer, on an existing Ray cluster or a local one.

- The recipe's layout is the worker group: devices x num_nodes workers, one per device, each with a GPU
  unless the accelerator is cpu. Ray places them (PACK: nodes filled in turn) and gives each worker
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT, and opens
  the process group (the recipe's backend and timeout) before training starts.
- In a worker, Fabric takes those ranks as Ray gave them (ray_worker.py), finds the process
  group open and starts no processes of its own; cluster/launchers.py refuses a placement other than
  the recipe's layout (devices workers on each of num_nodes nodes).
- Checkpoints are the project's own, in out_dir, which every worker must see (a shared filesystem on
  many nodes). When a worker dies, Ray Train ends the whole group and starts it again, up to
  `max_failures` times; the new group runs `train` with `checkpoint.resume: auto` and continues from
  the newest complete checkpoint, exactly, and appends to the same W&B run (its id is in the checkpoint).
- Every rank reports the step and its metrics to Ray (`ray.train.report`, a barrier across the
  workers) at each logging step: ray_worker.py's `RayReport`, one more Fabric logger. On Ray's controller,
  callbacks say each restart and what Ray received for the last step.

Ray runs the training function in a thread of the worker's process, from a folder of its own: the
worker moves to the folder `ray` was started from (when the node has it), so relative recipe paths
mean what they mean to `train`; stop signals are Ray's to handle (preemption.py catches none there).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from ..checkpoint.layout import checkpoint_root, find_latest
from ..errors import ExitCode, RecipeError, TrainingStopped, one_line
from ..project import PROJECT
from ..recipe.checks import check_hardware
from ..recipe.schema import Recipe
from .launchers import RAY_WORKER

INSTALL = f"pip install '{PROJECT}[ray]'"
CONNECT_SECONDS = 5.0  # an address that does not answer within this is refused (ray.init would wait for minutes)


def require_ray() -> None:
    """Refuse, before anything starts, where Ray Train is not installed."""
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise RecipeError(f"ray needs Ray Train, which is not installed here: {INSTALL}") from None


def check_reachable(address: str) -> None:
    """Refuse an address of host:port (or ray://host:port) where nothing answers."""
    where = address.split("://", 1)[-1]  # ray://host:port (Ray Client) or host:port (the head)
    host, _, port = where.rpartition(":")
    if address in ("auto", "local") or not port.isdigit():
        return  # Ray's own names: `ray start`'s cluster on this node, or a new one
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS):
            pass
    except OSError as error:
        raise RecipeError(
            f"--address {address}: no Ray cluster answers at {where} ({error.strerror or error}); give the head"
            " node's address (`ray start --head` prints it), or omit --address for a local cluster"
        ) from None


def connect(address: str | None) -> bool:
    """Join the cluster at `address` (else RAY_ADDRESS's, else a new local one); whether it was started here."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=True)
    except Exception as error:  # Ray's own words for an address it cannot use (ray:// without Ray Client, ...)
        raise RecipeError(f"Ray cluster {address or '(local)'}: {one_line(str(error) or repr(error))}") from None
    return address is None


def placed_recipe(recipe: Recipe, started_here: bool) -> Recipe:
    """The recipe with the accelerator the cluster gives it; refuses a layout the cluster cannot hold."""
    import ray

    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    where = "this machine's local Ray cluster" if started_here else "the Ray cluster"
    if recipe.accelerator == "cuda" and gpus == 0:
        raise RecipeError(
            f"accelerator=cuda but {where} has no GPU: add GPU nodes to it, or train with --accelerator cpu"
        )
    use_gpu = recipe.accelerator == "cuda" or (recipe.accelerator == "auto" and gpus > 0)
    accelerator: Literal["cpu", "cuda"] = "cuda" if use_gpu else "cpu"
    if accelerator == "cpu":
        try:
            check_hardware(recipe, "cpu", found=True)
        except RecipeError as error:
            raise RecipeError(f"{where} has no GPU: {error}") from None
        if started_here and cpus < recipe.world_size:  # Ray would wait for CPUs that never come
            raise RecipeError(
                f"devices={recipe.devices} x num_nodes={recipe.num_nodes} = {recipe.world_size} workers of one CPU"
                f" each, but {where} has {cpus} CPU(s): lower devices, or give --address of a larger cluster"
            )
    return replace(recipe, accelerator=accelerator)


def train_with_ray(recipe: Recipe, address: str | None, max_failures: int, train: Callable[[Recipe], Any]) -> None:
    """Train the recipe in Ray Train's workers with `train` (the loop, which the command passes down: this layer
    sits below it); prints the newest checkpoint, or raises why it failed."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    # Read by Ray Train's controller and workers (it hands them these variables of the driver): a worker's print
    # goes to its output once (Ray's patched print would write it twice, to the output and through its logger).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    started_here = connect(address)
    try:
        recipe = placed_recipe(recipe, started_here)
        use_gpu = recipe.accelerator == "cuda"
        trainer = TorchTrainer(
            train_in_worker,
            train_loop_config={"recipe": recipe, "folder": os.getcwd(), "train": train},
            scaling_config=ScalingConfig(num_workers=recipe.world_size, use_gpu=use_gpu, placement_strategy="PACK"),
            torch_config=TorchConfig(
                backend=recipe.strategy.process_group_backend, timeout_s=60 * recipe.strategy.timeout_minutes
            ),
            run_config=RunConfig(
                name="train",
                storage_path=str(Path(recipe.out_dir).resolve() / "ray"),
                failure_config=FailureConfig(max_failures=max_failures),
                callbacks=[failure_counter(max_failures), last_report(recipe.train.max_steps)],
            ),
        )
        print(
            f"ray: {recipe.world_size} worker(s), {'one GPU' if use_gpu else 'one CPU'} each, max_failures="
            f"{max_failures}; checkpoints: {checkpoint_root(recipe)}",
            flush=True,
        )
        stop_file(recipe).unlink(missing_ok=True)  # an earlier run's
        try:
            trainer.fit()
        except TrainingFailedError as error:
            raise TrainingStopped(f"ray: training failed: {worker_error(error)}", ExitCode.JOB_FAILED) from None
    finally:
        ray.shutdown()
    if stop_file(recipe).is_file():
        stopped = json.loads(stop_file(recipe).read_text())
        raise TrainingStopped(stopped["message"], ExitCode(stopped["exit_code"]))
    print(f"ray: done: {find_latest(checkpoint_root(recipe))}", flush=True)


def worker_error(error: Exception) -> str:
    """The lowest rank's error of a failed run in one line (the exception's own line under Ray's traceback)."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures):
        message = str(failures[rank]).strip()
        if message:
            return one_line(message.splitlines()[-1] if "Traceback" in message else message)
    return one_line(str(error).removeprefix("Training failed due to worker errors:").strip() or repr(error))


def train_in_worker(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: the config's `train` as the rank Ray gave it (Ray's thread, Ray's process group).

    A planned stop every rank agreed on (a non-finite loss, another run's lock) returns instead of raising,
    which Ray would answer by starting the group again, to the same stop: rank 0 writes it down for the driver.
    """
    import ray.train

    if Path(config["folder"]).is_dir():
        os.chdir(config["folder"])
    os.environ[RAY_WORKER] = "1"  # Fabric takes Ray's ranks, and reports to Ray (ray_worker.py)
    try:
        config["train"](config["recipe"])
    except TrainingStopped as stopped:
        if ray.train.get_context().get_world_rank() == 0:
            print(f"stopped: {stopped}", file=sys.stderr, flush=True)
            outcome = {"message": str(stopped), "exit_code": int(stopped.exit_code)}
            stop_file(config["recipe"]).parent.mkdir(parents=True, exist_ok=True)
            stop_file(config["recipe"]).write_text(json.dumps(outcome))


def stop_file(recipe: Recipe) -> Path:
    """Where rank 0 says why the run stopped early (Ray's result keeps only what comes with its own checkpoints)."""
    return Path(recipe.out_dir).resolve() / "ray" / "stopped.json"


def failure_counter(max_failures: int) -> Any:
    """A Ray Train callback (run on Ray's controller) that says in the log each time the worker group failed, and
    whether Ray starts it again: the restart count."""
    from ray.train import UserCallback

    class CountFailures(UserCallback):
        def __init__(self) -> None:
            self.failures = 0

        def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
            self.failures += 1
            ranks = ", ".join(str(rank) for rank in sorted(worker_exceptions)) or "?"
            if max_failures < 0 or self.failures <= max_failures:
                limit = "unlimited" if max_failures < 0 else max_failures
                print(
                    f"ray: restart {self.failures} of {limit}: the worker group failed (rank {ranks}); it starts"
                    " again and resumes from the newest checkpoint",
                    flush=True,
                )
            else:
                print(f"ray: the worker group failed (rank {ranks}) after {max_failures} restart(s): no more")

    return CountFailures()


def last_report(max_steps: int) -> Any:
    """A Ray Train callback (on Ray's controller) that says in the log what Ray received for the last step."""
    from ray.train import UserCallback

    class LastReport(UserCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            if metrics and metrics[0].get("step") == max_steps:
                print(f"ray: reported step {max_steps}, loss {metrics[0]['loss']:.6f} (rank 0)", flush=True)

    return LastReport()
