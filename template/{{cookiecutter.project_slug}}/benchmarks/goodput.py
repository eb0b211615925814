"""Goodput under failures: a 2-process run of fixed length, SIGKILLed at seeded random moments and resumed.

    python benchmarks/goodput.py --json out.json [--quick] [--repeats 2] [--steps 80] [--kill_every 25]

Each repeat runs, one after the other (interleaved: the machine's drift hits every variant alike):
    none       `train` (cpu-debug, 2 processes), no failures
    relaunch   the same, its whole process group SIGKILLed (a lost node) every `kill_every` seconds on average,
               at most `kills` times (the moments drawn from a seeded generator, uniform in 0.5..1.5 x `kill_every` after each launch,
               so a kill can land in the start-up, mid-step or in a save), relaunched with checkpoint.resume auto
    torchrun   the same under `torchrun --max-restarts`, one worker SIGKILLed: torchrun's elastic restart
               (only where torchrun is installed)
and reads what each lifetime logged (training/goodput.py) through `report`'s arithmetic: the run's goodput,
the kills, each lifetime's start-up in phases, the steps each restart redid. Nothing here is timed by the
harness except the kills: the figures are the run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
PACKAGE = "{{ cookiecutter.package_name }}"
sys.path.insert(0, str(PROJECT / "src"))

from {{ cookiecutter.package_name }}.commands.report import read_segments, run_goodput  # noqa: E402
from {{ cookiecutter.package_name }}.training.goodput import PHASES, REDONE, STARTUP, phase_key  # noqa: E402


def train_args(out_dir: Path, steps: int, save_every: int) -> list[str]:
    """`train` of cpu-debug for `steps` steps, a checkpoint every `save_every`, every step logged, resumed if it can."""
    return [
        "--config", str(PROJECT / "recipes" / "cpu-debug.yaml"), "--out_dir", str(out_dir),
        "--logger.name", "csv", "--logger.log_every_steps", "1", "--eval.every_steps", "0",
        "--train.max_steps", str(steps), "--checkpoint.save_every_steps", str(save_every),
        "--checkpoint.resume", "auto",
    ]  # fmt: skip


def environment() -> dict[str, str]:
    """The package importable, one thread per process (2 processes on the machine's cores), W&B quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT / "src"), env.get("PYTHONPATH")]))
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torchrun's restarts need their own store each (launchers.py)
    return env


def children(pid: int) -> list[int]:
    """The direct child processes of `pid` (Linux)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_with_kills(
    command: list[str],
    out_dir: Path,
    kill_every: float | None,
    kills_at_most: int,
    rng: random.Random,
    worker_only: bool,
) -> dict[str, Any]:
    """Run `command` until it ends with 0, SIGKILLing it every ~`kill_every` s (at most `kills_at_most` times):
    relaunched, or (`worker_only`) one of torchrun's workers killed and torchrun left to restart them."""
    started, kills = time.time(), 0
    with (out_dir.parent / f"{out_dir.name}.log").open("a") as log:
        launch = partial(subprocess.Popen, command, env=environment(), stdout=log, stderr=log, start_new_session=True)
        process = launch()
        try:
            while True:
                wait = kill_every * rng.uniform(0.5, 1.5) if kill_every and kills < kills_at_most else None
                try:
                    returncode = process.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    if worker_only:
                        workers = children(process.pid)[-1:]  # none between two of torchrun's rounds: no kill
                        for worker in workers:
                            os.kill(worker, signal.SIGKILL)  # torchrun restarts them all
                        kills += len(workers)
                    else:
                        kills += 1
                        os.killpg(process.pid, signal.SIGKILL)  # every rank, as a lost node
                        process.wait()
                        process = launch()
                    continue
                if returncode != 0:
                    raise RuntimeError(f"{' '.join(command)} ended with {returncode}: see {log.name}")
                return {"seconds": time.time() - started, "kills": kills}
        finally:  # this worker stopped (a timeout, ^C): its run stops with it
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def lifetimes(out_dir: Path) -> dict[str, Any]:
    """What the run's lifetimes logged: goodput, start-up per lifetime (and in phases), redone steps per restart."""
    segments = read_segments(out_dir)
    costs = run_goodput(segments)
    logged = [segment for segment in segments if STARTUP in segment.series]

    def first(segment: Any, key: str) -> float:
        return float(segment.series[key][0][1])

    return {
        "goodput": costs.goodput,
        "steps": costs.steps,
        "step_seconds": costs.step_seconds,
        "wall_seconds": costs.wall_seconds,
        "startup_seconds": [first(segment, STARTUP) for segment in logged],
        "phase_seconds": [{phase: first(segment, phase_key(phase)) for phase in PHASES} for segment in logged],
        "redone_steps": [int(first(segment, REDONE)) for segment in logged[1:]],
        "lost_seconds": [lost for lost in costs.lost_seconds[1:] if lost is not None],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="File to write the figures to.")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: checks that it runs.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="Optimizer steps of each run.")
    parser.add_argument("--save_every", type=int, default=10, help="checkpoint.save_every_steps.")
    parser.add_argument("--kill_every", type=float, default=25.0, help="Mean seconds between kills (> start-up).")
    parser.add_argument("--kills", type=int, default=10, help="Kills per run at most (then it runs to its end).")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the kill moments.")
    parser.add_argument("--launchers", default="relaunch,torchrun", help="Restarts to measure, beside none.")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.save_every, args.kills = 1, 12, 4, 1
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(1))  # a timeout's SIGTERM stops the runs too
    variants = ["none", *args.launchers.split(",")]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None and "torchrun" in variants:
        variants.remove("torchrun")
        print("torchrun is not installed beside this Python: its restarts are not measured", file=sys.stderr)
    results: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as folder:
        for repeat in range(args.repeats):
            for variant in variants if repeat % 2 == 0 else variants[::-1]:
                out_dir = Path(folder) / f"{variant}-{repeat}"
                rng = random.Random(args.seed * 1000 + repeat)  # the same kill moments for each variant
                train = train_args(out_dir, args.steps, args.save_every)
                if variant == "torchrun":
                    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "40"]
                    command += ["--monitor-interval", "0.5", "-m", PACKAGE, "train", *train]
                else:
                    command = [sys.executable, "-m", PACKAGE, "train", *train]
                kill_every = None if variant == "none" else args.kill_every
                worker_only = variant == "torchrun"
                outcome = run_with_kills(command, out_dir, kill_every, args.kills, rng, worker_only=worker_only)
                outcome |= lifetimes(out_dir)
                results[variant].append(outcome)
                print(
                    f"  repeat {repeat + 1} {variant}: goodput {outcome['goodput']:.3f}, {outcome['kills']} kills,"
                    f" start-ups {[round(s, 1) for s in outcome['startup_seconds']]} s,"
                    f" redone {outcome['redone_steps']}",
                    file=sys.stderr,
                    flush=True,
                )
    settings = {key: getattr(args, key) for key in ("steps", "save_every", "kill_every", "kills", "seed", "repeats")}
    Path(args.json).write_text(json.dumps({"settings": settings, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
