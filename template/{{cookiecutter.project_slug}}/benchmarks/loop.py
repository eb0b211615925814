"""The project's loop against a hand-written loop on the same model, eager and compiled; host syncs per step.

    python benchmarks/loop.py --json loop.json                # what benchmarks/run.py runs: one process, 2 threads
    python benchmarks/loop.py --json loop.json --quick        # tiny sizes (a run, not a measurement)
    python benchmarks/loop.py --json scaling.json --only project --devices 2 --threads 1   # a scaling run

The project's loop is `train.train(recipe)` as a user runs it (setup, data, decisions, logging,
checkpoint at the end); the hand-written one is the least a training loop does with the same
GPT, AdamW groups, LR schedule and clipping, on random batches. Both are timed the same way, by
a global optimizer-step hook, from the end of step WARMUP_STEPS to the end of the last step, so
start-up, compilation and the final checkpoint stay outside the window. Variants alternate within
each repeat so that the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-debug.yaml"
WARMUP_STEPS = 5
WORK_DIR = "LOOP_BENCH_DIR"  # chosen before a multi-process run launches its other processes, which inherit it


def recipe_for(args: argparse.Namespace, compile_blocks: bool, out_dir: str, profile_steps: str = "[]") -> Any:
    """The benchmark's recipe: cpu-debug at the benchmark's sizes, on `args.devices` processes; `profile_steps`: its
    profile.steps."""
    from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

    overrides = {
        "devices": args.devices,
        "out_dir": out_dir,
        "strategy.name": args.strategy,
        "strategy.compile": str(compile_blocks).lower(),
        "model.n_layer": args.n_layer,
        "model.n_embd": args.n_embd,
        "model.n_head": max(1, args.n_embd // 64),
        "model.block_size": args.block_size,
        "train.micro_batch_size": args.micro_batch_size,
        "train.max_steps": args.steps,
        "eval.every_steps": 0,
        "checkpoint.save_every_steps": 0,
        "checkpoint.resume": "null",
        "logger.name": "none",
        "logger.log_every_steps": args.log_every_steps,
        "profile.steps": profile_steps,
    }
    argv = ["--config", str(RECIPE)]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return parse_recipe(argv)


@contextlib.contextmanager
def step_clock(warmup: int) -> Iterator[dict[str, float]]:
    """Seconds from the end of optimizer step `warmup` to the end of the last step, from a global step hook."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    timing = {"steps": 0, "start": 0.0, "end": 0.0, "cpu_start": 0.0, "cpu_end": 0.0}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        timing["steps"] += 1
        if timing["steps"] == warmup:
            timing["start"], timing["cpu_start"] = time.perf_counter(), time.process_time()
        timing["end"], timing["cpu_end"] = time.perf_counter(), time.process_time()

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield timing
    finally:
        handle.remove()
        steps = max(1, timing["steps"] - warmup)
        timing["seconds_per_step"] = (timing["end"] - timing["start"]) / steps
        # CPU seconds of this process: less disturbed than wall time by other work on a shared machine.
        timing["cpu_seconds_per_step"] = (timing["cpu_end"] - timing["cpu_start"]) / steps


RUNS = itertools.count()


@contextlib.contextmanager
def run_folder() -> Iterator[str]:
    """A fresh out_dir for one run, the same on every rank, with the run's progress lines kept out of the output."""
    out_dir = Path(os.environ[WORK_DIR]) / f"run-{next(RUNS)}"
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield str(out_dir)


def project_loop(args: argparse.Namespace, compile_blocks: bool) -> tuple[float, float]:
    """(wall, CPU) seconds per step of `train.train` (the project's loop) on the benchmark's recipe."""
    from {{ cookiecutter.package_name }}.training.loop import train

    with run_folder() as out_dir, step_clock(WARMUP_STEPS) as timing:
        train(recipe_for(args, compile_blocks, out_dir))
    return timing["seconds_per_step"], timing["cpu_seconds_per_step"]


def profiled_loop(args: argparse.Namespace, compile_blocks: bool) -> tuple[float, float]:
    """The same as `project_loop` with profile.steps naming step 2: the timed steps are its other steps."""
    from {{ cookiecutter.package_name }}.training.loop import train

    with run_folder() as out_dir, step_clock(WARMUP_STEPS) as timing:
        train(recipe_for(args, compile_blocks, out_dir, profile_steps="[2]"))
    return timing["seconds_per_step"], timing["cpu_seconds_per_step"]


def handwritten_loop(args: argparse.Namespace, compile_blocks: bool) -> tuple[float, float]:
    """(wall, CPU) seconds per step of the least a training loop does: the same GPT, AdamW groups, schedule and clipping."""
    import torch
    import torch.nn.functional as F

    from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import GPT
    from {{ cookiecutter.package_name }}.training.optim import build_optimizer, build_scheduler

    recipe = recipe_for(args, compile_blocks, tempfile.gettempdir())
    config, train_config = recipe.model, recipe.train
    torch.manual_seed(train_config.seed)
    model = GPT(config)
    for block in model.blocks:
        if compile_blocks:
            block.compile()
    optimizer = build_optimizer(model, train_config)
    scheduler = build_scheduler(optimizer, train_config)
    model.train()
    shape = (train_config.micro_batch_size, config.block_size)
    with step_clock(WARMUP_STEPS) as timing:
        for _ in range(train_config.max_steps):
            inputs, targets = torch.randint(0, config.vocab_size, shape), torch.randint(0, config.vocab_size, shape)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return timing["seconds_per_step"], timing["cpu_seconds_per_step"]


class HostSyncCounter:
    """Counts what makes the host wait for the device: reading a tensor's value and waiting on a collective.

    Patched in for one run: Tensor.item/tolist/__bool__/__float__/__int__ and the blocking
    torch.distributed collectives. Reads inside `optimizer.step` are not counted: AdamW keeps its
    step counts on the host, so they never wait for a GPU. Counts are kept per optimizer step.
    """

    TENSOR_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._count = 0
        self._in_optimizer = False

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostSyncCounter]:
        import torch
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        originals: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, is_blocking: Callable[[tuple, dict], bool]) -> None:
            original = getattr(owner, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                if not self._in_optimizer and is_blocking(args, kwargs):
                    self._count += 1
                return original(*args, **kwargs)

            originals.append((owner, name, original))
            setattr(owner, name, counted)

        for name in self.TENSOR_READS:
            patch(torch.Tensor, name, lambda args, kwargs: True)
        for name in self.COLLECTIVES:
            patch(dist, name, lambda args, kwargs: not kwargs.get("async_op", False))

        def before(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._in_optimizer = True

        def after(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._in_optimizer = False
            self.per_step.append(self._count)
            self._count = 0

        handles = [
            register_optimizer_step_pre_hook(before),
            register_optimizer_step_post_hook(after),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for owner, name, original in originals:
                setattr(owner, name, original)

    def outside_logging_steps(self, log_every: int) -> list[int]:
        """Syncs of each step that logs nothing; a step's count runs from the previous step to its optimizer step,
        so it includes the end of the previous step (the decision, logging, checkpoint polling)."""
        return [count for step, count in enumerate(self.per_step[1:], start=1) if step % log_every]


def count_host_syncs(args: argparse.Namespace) -> list[int]:
    """Host syncs per step of the project's loop (steps that log nothing), eager."""
    from {{ cookiecutter.package_name }}.training.loop import train

    counter = HostSyncCounter()
    counted = argparse.Namespace(**{**vars(args), "steps": 2 * args.log_every_steps + 2})  # a count: a short run
    with run_folder() as out_dir, counter.counting():
        train(recipe_for(counted, False, out_dir))
    return counter.outside_logging_steps(args.log_every_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="File to write the timings to.")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: a run, not a measurement.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only",
        choices=("project", "all", "profile"),
        default="all",
        help="project: its loop only; all: and the hand-written one; profile: and with profile.steps set",
    )
    parser.add_argument("--compile", choices=("both", "eager", "compiled"), default="both")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--warmup_rounds",
        type=int,
        default=0,
        help="Untimed rounds first (the window already starts after compilation).",
    )
    args = parser.parse_args()
    args.n_layer, args.n_embd, args.block_size, args.micro_batch_size = (
        (2, 64, 64, 4) if args.quick else (4, 128, 256, 8)
    )
    args.log_every_steps = 10
    if args.quick:
        args.steps, args.repeats = min(args.steps, 12), min(args.repeats, 1)

    import torch

    torch.set_num_threads(args.threads)
    work = Path(os.environ.setdefault(WORK_DIR, tempfile.mkdtemp(prefix="loop-bench-")))
    loops: dict[str, Callable[[argparse.Namespace, bool], tuple[float, float]]] = {"project": project_loop}
    if args.only == "all":
        loops["handwritten"] = handwritten_loop
    if args.only == "profile":
        loops["profiled"] = profiled_loop
    modes = {"both": (False, True), "eager": (False,), "compiled": (True,)}[args.compile]
    variants = [(name, mode) for mode in modes for name in loops]
    seconds: dict[str, list[float]] = {f"{name}_{'compiled' if mode else 'eager'}": [] for name, mode in variants}
    cpu_seconds: dict[str, list[float]] = {key: [] for key in seconds}
    for _ in range(args.warmup_rounds):  # untimed: compilation caches, allocator, page cache
        for name, mode in variants:
            loops[name](args, mode)
    for repeat in range(args.repeats):
        for name, mode in variants if repeat % 2 == 0 else variants[::-1]:  # no variant always runs first
            key = f"{name}_{'compiled' if mode else 'eager'}"
            wall, cpu = loops[name](args, mode)
            seconds[key].append(wall)
            cpu_seconds[key].append(cpu)
            print(f"  repeat {repeat + 1}/{args.repeats} {key}: {seconds[key][-1] * 1e3:.1f} ms/step", file=sys.stderr)
    result: dict[str, Any] = {"seconds_per_step": seconds, "cpu_seconds_per_step": cpu_seconds}
    result["threads"] = torch.get_num_threads()
    if args.only == "all":
        result["host_syncs_per_step"] = count_host_syncs(args)
    result["tokens_per_step"] = args.micro_batch_size * args.block_size * args.devices
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        Path(args.json).write_text(json.dumps(result, indent=2))
        shutil.rmtree(work, ignore_errors=True)
    from {{ cookiecutter.package_name }}.errors import exit_process

    exit_process(0)  # leave the process group (a scaling run's) as the command line does


if __name__ == "__main__":
    main()
