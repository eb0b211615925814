"""Checkpoint I/O benchmark: sync save, async save (time blocked), load, bytes, against the disk's own write speed
and a plain memory copy of the same state.

    python benchmarks/checkpoint_io.py                       # ~76M-parameter GPT, FSDP2 on 2 CPU processes
    python benchmarks/checkpoint_io.py --devices 1 --n_layer 12 --repeats 3

All figures come from one run on one disk, so the save throughput is read as a ratio to the
sequential write speed measured here (written with fsync per file, as torch.distributed.checkpoint does),
and an async save's blocked time as a ratio to copying the state once in memory (the least a save
that lets training go on must do). `benchmarks/run.py` runs it in rounds and reports those ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.checkpoint.io import Checkpointer
from {{ cookiecutter.package_name }}.checkpoint.load import load_checkpoint
from {{ cookiecutter.package_name }}.errors import exit_process
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.families import count_parameters
from {{ cookiecutter.package_name }}.training.run import setup

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-debug.yaml"


def disk_write_speed(folder: Path, total_bytes: int, files: int) -> float:
    """Bytes per second writing `total_bytes` split over `files` files, each fsynced."""
    chunk = os.urandom(1 << 20)
    per_file = max(1, total_bytes // files // len(chunk))
    start = time.perf_counter()
    for index in range(files):
        with open(folder / f"probe-{index}", "wb") as handle:
            for _ in range(per_file):
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    for index in range(files):
        (folder / f"probe-{index}").unlink()
    return files * per_file * len(chunk) / seconds


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def memory_copy_seconds(state: dict) -> float:
    """Seconds to copy this rank's model and optimizer state (its local shards) into host tensors made before."""
    from torch.distributed.tensor import DTensor

    tensors = [value for value in state["model"].state_dict().values()]
    for values in state["optimizer"].state.values():
        tensors += [value for value in values.values() if torch.is_tensor(value)]
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    copies = [torch.empty_like(tensor, device="cpu") for tensor in local]
    for target, tensor in zip(copies, local, strict=True):  # touch every page first: time the copy alone
        target.copy_(tensor)
    start = time.perf_counter()
    for target, tensor in zip(copies, local, strict=True):
        target.copy_(tensor)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="Rounds of (copy, sync save, async save, load, disk).")
    parser.add_argument("--dir", default=None, help="Where to write (default: a temporary folder).")
    parser.add_argument("--json", default=None, help="Also write every round's figures to this file (rank 0).")
    args = parser.parse_args()

    # Chosen before Fabric launches the other processes, which inherit the environment.
    work = Path(args.dir or os.environ.setdefault("CHECKPOINT_BENCH_DIR", tempfile.mkdtemp(prefix="ckpt-bench-")))
    recipe = load_recipe(RECIPE)
    recipe.devices, recipe.out_dir, recipe.logger.name = args.devices, str(work), "none"
    recipe.model.n_layer, recipe.model.n_embd, recipe.model.n_head = args.n_layer, args.n_embd, 16
    recipe.train.micro_batch_size, recipe.train.seed, recipe.checkpoint.resume = 1, 0, None
    recipe.checkpoint.keep_last = 2
    run = setup(recipe)
    fabric, model, optimizer, state = run.fabric, run.model, run.optimizer, run.state
    parameters = count_parameters(recipe.model)
    inputs, targets = fabric.to_device(run.batches.next_step()[0])
    fabric.backward(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()  # populates the AdamW state, as in a real checkpoint

    def slowest(seconds: float) -> float:
        """The figure of the slowest rank: the loop waits for it."""
        return float(fabric.all_reduce(torch.tensor(seconds), reduce_op="max"))

    sync_saver = Checkpointer(fabric, recipe)
    async_recipe = copy.deepcopy(recipe)  # a Checkpointer reads its recipe's options at every save
    async_recipe.checkpoint.async_save = True
    async_saver = Checkpointer(fabric, async_recipe)  # its own process group, made once as in a run
    # The first async save of a run makes the host copies that later saves reuse; the rounds measure those.
    state["step"] += 1
    first_async_blocked = slowest(async_saver.save(state))
    async_saver.wait()
    rounds = []
    for _ in range(args.repeats):
        fabric.barrier()
        copy_seconds = slowest(memory_copy_seconds(state))

        state["step"] += 1
        sync_seconds = slowest(sync_saver.save(state))
        checkpoint = work / "checkpoints" / f"step-{state['step']:08d}"
        written = folder_bytes(checkpoint / "state")

        state["step"] += 1
        start = time.perf_counter()
        async_blocked = slowest(async_saver.save(state))
        async_saver.wait()
        async_total = slowest(time.perf_counter() - start)

        fabric.barrier()
        start = time.perf_counter()
        load_checkpoint(fabric, checkpoint, state, recipe)
        fabric.barrier()
        load_seconds = time.perf_counter() - start
        disk = disk_write_speed(work, written, files=fabric.world_size) if fabric.global_rank == 0 else 0.0
        fabric.barrier()
        rounds.append(
            {
                "bytes": written,
                "memory_copy_s": copy_seconds,
                "sync_save_s": sync_seconds,
                "async_blocked_s": async_blocked,
                "async_total_s": async_total,
                "load_s": load_seconds,
                "disk_bytes_per_s": disk,
            }
        )

    if fabric.global_rank == 0:
        last = rounds[-1]
        written, disk, sync_seconds = last["bytes"], last["disk_bytes_per_s"], last["sync_save_s"]
        copy_seconds, async_blocked = last["memory_copy_s"], last["async_blocked_s"]
        rows = [
            ("model parameters", f"{parameters / 1e6:.1f} M"),
            ("processes (FSDP2 shards)", f"{fabric.world_size}"),
            ("bytes written per checkpoint", f"{written / 2**20:.0f} MiB"),
            ("disk sequential write (fsync)", f"{disk / 2**20:.0f} MiB/s"),
            ("memory copy of the state", f"{copy_seconds:.2f} s"),
            (
                "sync save",
                f"{sync_seconds:.2f} s = {written / sync_seconds / 2**20:.0f} MiB/s = {written / sync_seconds / disk:.2f}x disk",
            ),
            (
                "async save: loop blocked",
                f"{async_blocked:.2f} s = {async_blocked / sync_seconds:.2f}x sync save"
                f" = {async_blocked / copy_seconds:.1f}x memory copy",
            ),
            ("async save: until written", f"{last['async_total_s']:.2f} s"),
            ("async save: the run's first", f"{first_async_blocked:.2f} s blocked (makes the host copies)"),
            ("load", f"{last['load_s']:.2f} s = {written / last['load_s'] / 2**20:.0f} MiB/s"),
        ]
        width = max(len(name) for name, _ in rows)
        print(f"checkpoint I/O in {work} (the last of {len(rounds)} rounds)")
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")
        if args.json:
            result = {"parameters": parameters, "first_async_blocked_s": first_async_blocked, "repeats": rounds}
            Path(args.json).write_text(json.dumps(result, indent=2))
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    exit_process(0)  # leave the process group as the command line does


if __name__ == "__main__":
    main()
