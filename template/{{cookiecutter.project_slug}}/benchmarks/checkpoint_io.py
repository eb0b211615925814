"""Checkpoint I/O benchmark: sync save, async save (time blocked), load, bytes, against the disk's own write speed.

    python benchmarks/checkpoint_io.py                       # ~76M-parameter GPT, FSDP2 on 2 CPU processes
    python benchmarks/checkpoint_io.py --devices 1 --n_layer 12

All figures come from one run on one disk, so the save throughput is read as a ratio to the
sequential write speed measured here (written with fsync per file, as torch.distributed.checkpoint does).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch.nn.functional as F

from {{ cookiecutter.package_name }}.checkpoint import Checkpointer, load_checkpoint
from {{ cookiecutter.package_name }}.errors import exit_process
from {{ cookiecutter.package_name }}.models import count_parameters
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.run import setup

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="Where to write (default: a temporary folder).")
    args = parser.parse_args()

    # Chosen before Fabric launches the other processes, which inherit the environment.
    work = Path(args.dir or os.environ.setdefault("CHECKPOINT_BENCH_DIR", tempfile.mkdtemp(prefix="ckpt-bench-")))
    recipe = load_recipe(RECIPE)
    recipe.devices, recipe.out_dir, recipe.logger.name = args.devices, str(work), "none"
    recipe.model.n_layer, recipe.model.n_embd, recipe.model.n_head = args.n_layer, args.n_embd, 16
    recipe.train.micro_batch_size, recipe.train.seed, recipe.checkpoint.resume = 1, 0, None
    run = setup(recipe)
    fabric, model, optimizer, state = run.fabric, run.model, run.optimizer, run.state
    parameters = count_parameters(recipe.model)
    inputs, targets = fabric.to_device(run.batches.next_step()[0])
    fabric.backward(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()  # populates the AdamW state, as in a real checkpoint
    state["step"] = 1

    sync_saver = Checkpointer(fabric, recipe)
    sync_seconds = sync_saver.save(state)
    checkpoint = work / "checkpoints" / "step-00000001"
    written = folder_bytes(checkpoint / "state")

    recipe.checkpoint.async_save = True
    async_saver = Checkpointer(fabric, recipe)
    state["step"] = 2
    start = time.perf_counter()
    async_blocked = async_saver.save(state)
    async_saver.wait()
    async_total = time.perf_counter() - start

    fabric.barrier()
    start = time.perf_counter()
    load_checkpoint(fabric, checkpoint, state, recipe)
    fabric.barrier()
    load_seconds = time.perf_counter() - start

    if fabric.global_rank == 0:
        disk = disk_write_speed(work, written, files=fabric.world_size)
        rows = [
            ("model parameters", f"{parameters / 1e6:.1f} M"),
            ("processes (FSDP2 shards)", f"{fabric.world_size}"),
            ("bytes written per checkpoint", f"{written / 2**20:.0f} MiB"),
            ("disk sequential write (fsync)", f"{disk / 2**20:.0f} MiB/s"),
            (
                "sync save",
                f"{sync_seconds:.2f} s = {written / sync_seconds / 2**20:.0f} MiB/s = {written / sync_seconds / disk:.2f}x disk",
            ),
            ("async save: loop blocked", f"{async_blocked:.2f} s = {async_blocked / sync_seconds:.2f}x sync save"),
            ("async save: until written", f"{async_total:.2f} s"),
            ("load", f"{load_seconds:.2f} s = {written / load_seconds / 2**20:.0f} MiB/s"),
        ]
        width = max(len(name) for name, _ in rows)
        print(f"checkpoint I/O in {work}")
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    exit_process(0)  # leave the process group as the command line does


if __name__ == "__main__":
    main()
