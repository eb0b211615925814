"""The errors a user sees, every exit code the project uses, how a command turns them into an exit, and the
option spelling every command line is checked for before anything else reads it.

Nothing here imports torch: the command line refuses bad input before torch is loaded.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of every command; launchers and job scripts act on them."""

    OK = 0
    JOB_FAILED = 1  # `submit --wait`: the job failed or ended unfinished; its log says why
    USAGE = 2  # a recipe, flag, path or checkpoint that cannot run: one line on stderr, nothing written
    NONFINITE_LOSS = 3  # train.on_nonfinite_loss=stop: the loss was NaN or infinite on some rank
    SAVE_FAILED = 74  # EX_IOERR from sysexits.h: a checkpoint could not be written (disk full); the last one is kept
    REQUEUE = 75  # EX_TEMPFAIL from sysexits.h: preempted, checkpoint saved, run again (SLURM requeue)


class RecipeError(ValueError):
    """A recipe that cannot run; the message is one line that names the field and what is allowed."""


class TrainingStopped(Exception):
    """Training stopped before max_steps: preempted, a non-finite loss, or a submitted job failed; one-line message.

    `report` is true on the one process that prints it (rank 0); every rank stops for the same reason.
    """

    def __init__(self, message: str, exit_code: ExitCode, report: bool = True) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.report = report


MAX_ERROR_CHARACTERS = 1000
# An option word spelled with a dash inside its name: `--max-new-tokens`, `--train.max-steps=5`.
DASHED_OPTION = re.compile(r"--[A-Za-z][\w.]*(?:-[\w.]+)+")


def refuse_dashed_options(argv: list[str]) -> None:
    """Every option is spelled with underscores, the commands' own as the recipe fields beside them
    (`--max_new_tokens`, `--gpu_memory_gib`, `--num_nodes`, `--train.max_steps`): a dashed spelling is refused
    naming the right one, rather than read as an abbreviation or an unknown field."""
    for word in argv:
        if word == "--":  # what follows is not options
            return
        name = word.split("=", 1)[0]
        if DASHED_OPTION.fullmatch(name):
            raise RecipeError(f"{name}: options are spelled with underscores: --{name[2:].replace('-', '_')}")


def one_line(message: str) -> str:
    """An error as printed: its first line, cut to MAX_ERROR_CHARACTERS (a value quoted in it may be huge)."""
    line = message.splitlines()[0] if message.strip() else message
    return line if len(line) <= MAX_ERROR_CHARACTERS else line[: MAX_ERROR_CHARACTERS - 3] + "..."


def run_command(command: Callable[[], None]) -> None:
    """Run a command and end the process: user errors become one line and exit code 2, planned stops their code."""
    code = ExitCode.OK
    try:
        command()
    except RecipeError as error:
        print(f"error: {one_line(str(error))}", file=sys.stderr)
        code = ExitCode.USAGE
    except TrainingStopped as stopped:  # preempted (exit 75: requeued) or a non-finite loss (exit 3)
        if stopped.report:  # a refusal found only once the processes run (a damaged checkpoint) reads as one
            said = "error" if stopped.exit_code == ExitCode.USAGE else "stopped"
            print(f"{said}: {one_line(str(stopped))}", file=sys.stderr, flush=True)
        code = stopped.exit_code
    except BrokenPipeError:  # `<project> recipes list | head -1`: the reader has gone, which is not an error
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    exit_process(int(code))


def exit_process(code: int) -> None:
    """End with exit code `code`; a process that joined a process group leaves it and skips interpreter teardown.

    Gloo's worker threads can still be releasing the last collective's tensors while the interpreter
    tears down; the thread then cannot take the GIL and the process aborts ("terminate called without
    an active exception", SIGABRT), replacing the exit code (3, 75) that launchers and the SLURM
    script act on. By now checkpoints are written and loggers finished, so only streams need flushing.
    """
    distributed = sys.modules.get("torch.distributed")  # imported only if this process trained
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
