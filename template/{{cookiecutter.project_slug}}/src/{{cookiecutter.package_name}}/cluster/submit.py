"""The submitit side of `<project> submit RECIPE` (commands/submit.py parses and checks it): train on SLURM through
submitit, or on this machine with `--local`; a preempted or timed-out job saves, is requeued by submitit and
resumes exactly.

The job runs the project's own `train` in-process in every task: one task per device, `devices` tasks on
each of `num_nodes` nodes, `checkpoint.resume: auto` as in scripts/slurm/train.sbatch. The recipe is
resolved and checked by the command, before submitit or torch is imported, and travels in the job's pickle. Fabric
reads the ranks from SLURM's variables; on this machine, from torch.distributed's, exported from
submitit's local environment.

How submitit's signal meets preemption.py (read from submitit 1.5.4's source):
- Each task runs `python -m submitit.core._submit FOLDER` (under srun, or as a subprocess of the local
  controller): it loads the pickled `Training`, installs a handler for submitit's signal (SIGUSR2: SLURM
  sends it `--signal=USR2@120` before the time limit; the local controller 120 s before its own), and
  calls it. On rank 0 that handler calls the callable's `checkpoint()` and exits at once, mid-step: the
  step is lost and the other ranks are left in a collective.
- So `Training` sets that handler aside and, first thing (before torch is imported), puts preemption.py's
  flag in its place: the ranks agree at the next step boundary, all save that step and stop (in a
  submitit job preemption.py does not run `scontrol requeue` itself).
- Then every rank hands the agreed signal to submitit's handler. On rank 0 it takes `checkpoint()`'s
  resubmission (this same training), writes it over the job's pickle, counts a time limit against
  `--max_timeouts` (a signal after min(80% of the limit, the limit less 10 minutes) is one), and
  requeues: `scontrol requeue` on SLURM; on this machine exit code 144, on which the local controller
  starts the tasks again once all have exited (6 starts at most). On the other ranks it does nothing. No rank returns, so submitit writes no
  result and its job object sees the job still running; the requeued tasks load the pickle again and
  `checkpoint.resume: auto` resumes from the saved step, bitwise (tests/e2e/test_submit.py).
- Past `--max_timeouts` the handler raises instead: rank 0's error is the job's result, the job fails,
  and its checkpoints stay for a new submission.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..checkpoint.layout import checkpoint_root, find_latest
from ..errors import ExitCode, RecipeError, TrainingStopped, exit_process
from ..recipe.schema import Recipe
from .jobs import gpus_per_node
from .preemption import SIGNALS, Preempted, Preemption
from .slurm import SIGNAL_SECONDS_BEFORE_LIMIT

if TYPE_CHECKING:
    from submitit import Executor, Job
    from submitit.helpers import DelayedSubmission

INSTALL = 'pip install ".[submitit]"'


def executor(options: Any, recipe: Recipe, seconds: int) -> Executor:
    """submitit's local or SLURM executor, asking for the recipe's layout; refuses if submitit cannot run it."""
    try:
        import submitit
    except ImportError:
        raise RecipeError(f"submit needs submitit, which is not installed: {INSTALL}") from None
    submitits_signal = signal.Signals.__members__.get(f"SIG{submitit.JobEnvironment.USR_SIG}")
    if submitits_signal not in SIGNALS:
        caught = ", ".join(signum.name for signum in SIGNALS)
        raise RecipeError(
            f"submitit would signal the job with SIG{submitit.JobEnvironment.USR_SIG} (SUBMITIT_PREEMPT_SIGNAL), which"
            f" training does not catch: it saves on {caught} (unset SUBMITIT_PREEMPT_SIGNAL: submitit then sends USR2)"
        )
    if options.local:
        local = submitit.LocalExecutor(folder=options.folder, max_num_timeout=options.max_timeouts)
        local.update_parameters(
            timeout_min=seconds / 60,
            tasks_per_node=recipe.devices,
            gpus_per_node=gpus_per_node(recipe),
            signal_delay_s=SIGNAL_SECONDS_BEFORE_LIMIT,
        )
        return local
    slurm = submitit.SlurmExecutor(folder=options.folder, max_num_timeout=options.max_timeouts)
    parameters = dict(
        job_name=options.job_name,
        nodes=recipe.num_nodes,
        ntasks_per_node=recipe.devices,
        cpus_per_task=options.cpus_per_task,
        time=math.ceil(seconds / 60),
        signal_delay_s=SIGNAL_SECONDS_BEFORE_LIMIT,
        additional_parameters=dict(requeue=True),  # as scripts/slurm/train.sbatch: the job may be requeued
    )
    wanted = dict(gpus_per_node=gpus_per_node(recipe), partition=options.partition, account=options.account)
    slurm.update_parameters(**parameters, **{key: value for key, value in wanted.items() if value})
    return slurm


def wait(job: Job[Any]) -> None:
    """Wait for the job to end (through requeues); say where it ended, or why it failed (exit code 1)."""
    from submitit.core.utils import UncompletedJobError

    try:
        newest = job.results()[0]
    except UncompletedJobError as error:
        parts = str(error).split("-" * 22)  # FailedJobError: the job's traceback between two rules
        reason = parts[1].strip().splitlines()[-1] if len(parts) > 2 else str(error).splitlines()[0]
        message = f"job {job.job_id} failed: {reason} (log: {job.paths.stderr})"
        raise TrainingStopped(message, ExitCode.JOB_FAILED) from None
    print(f"job {job.job_id} done: {newest}")


class Training:
    """What every task of a submitted job runs: `train(recipe)`; when preempted, submitit requeues it."""

    def __init__(self, recipe: Recipe, train: Callable[[Recipe, Preemption], Any]) -> None:
        self.recipe = recipe
        self.train = train  # the loop, which the command passes down (this layer sits below it); pickled by name

    def __call__(self) -> str:
        """Train as this task's rank; the newest checkpoint when done. A preempted task exits, requeued."""
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        environment = submitit.JobEnvironment()
        checkpoint_and_requeue = signal.getsignal(signal.Signals[f"SIG{environment.USR_SIG}"])
        preemption = Preemption()  # replaces submitit's handler: a flag, acted on at the next step boundary
        if environment.cluster == "local":  # no SLURM variables: tell Fabric the ranks as torch.distributed's
            ranks = TorchDistributedEnvironment()  # the main port: a function of the job id, the same in every task
            ranks.master_addr = "127.0.0.1"  # one machine, whatever its host name resolves to
            ranks.export(set_cuda_visible_devices=False, overwrite=True)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        try:
            self.train(self.recipe, preemption)
        except Preempted as stopped:
            if stopped.report:
                print(f"stopped: {stopped}", file=sys.stderr, flush=True)
            code = int(ExitCode.REQUEUE)
            if callable(checkpoint_and_requeue):
                try:  # rank 0: checkpoint() and requeue; the other ranks return at once
                    checkpoint_and_requeue(stopped.signal, None)
                except SystemExit as exited:  # on this machine 144 (the controller requeues on it), else -1
                    code = exited.code if isinstance(exited.code, int) else int(ExitCode.JOB_FAILED)
            exit_process(code)  # not a return: submitit writes a result only when the call returns or raises
        import torch.distributed

        if torch.distributed.is_initialized():  # before submitit writes the result and the interpreter ends
            torch.distributed.destroy_process_group()
        return str(find_latest(checkpoint_root(self.recipe)))

    def checkpoint(self) -> DelayedSubmission:
        """What submitit requeues: this same training, which resumes from the newest checkpoint."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)
