"""Every benchmark of the project in one command: one table, `benchmarks/results/latest.json`.

    python benchmarks/run.py            # the measurement (under 10 minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # tiny sizes: checks that every benchmark runs, measures nothing

Every figure is a ratio of two things measured side by side in this run, on this machine, in
alternating (interleaved) repeats so that the machine's drift hits both alike; the table gives the
median over repeats and the spread (min..max). The workers are the other files of this folder:

    loop.py           the project's loop against a hand-written loop, eager and compiled; host syncs per
                      step; a run for the scaling figure; the loop with profile.steps naming other steps
    state.py          training state per rank under fsdp2 against ddp (2 processes)
    checkpoint_io.py  sync save against the disk, async save's blocked time against a memory copy, load
    step_sync.py      one fused all_reduce per step against one collective per decision
    training_defaults.py  AdamW's fused kernel against torch's default; selective activation checkpointing
                      against full and none (time, and the bytes held for backward)
    shard_cache.py    data wait per step through the shard cache from S3 (moto on localhost), cold and warm,
                      against the same folder read locally
    context_parallel.py  activations held for backward per rank and step time, cp=2 on 2 processes against
                      whole sequences on 1 (the same sequences)
    moe.py            tokens/s through a mixture of experts' experts, grouped GEMM against a loop over experts
    goodput.py        a 2-process run SIGKILLed every ~25 s and resumed (relaunched; torchrun's elastic restarts)
                      against the same run without failures: goodput, kills, each start-up phase, redone steps
The start-up, pipeline and expert-parallel figures are measured here: command to first optimizer step against
`import torch, lightning`, and the same on prepared corpora of 1, 4 and 16 GB (sparse shards: no disk used,
nothing read at start); `train` under ddp and under a 2-stage pipeline on the same global batch, each step's time
as the run logs it, beside plan's bubble; cpu-moe-debug at expert parallel 2 against 1, likewise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
PACKAGE = "{{ cookiecutter.package_name }}"
RESULTS = HERE / "results" / "latest.json"

# (key, what it is, target as (comparison, bound) or None)
FIGURES: list[tuple[str, str, tuple[str, float] | None]] = [
    ("loop_vs_handwritten_eager", "project loop speed / hand-written, eager", (">=", 0.98)),
    ("loop_vs_handwritten_compiled", "project loop speed / hand-written, compiled blocks", (">=", 0.98)),
    ("compile_gain_ratio", "compile speed-up of the project / of the hand-written loop", (">=", 0.98)),
    ("loop_vs_handwritten_eager_cpu_time", "the same in CPU seconds of the process", (">=", 0.98)),
    ("loop_vs_handwritten_compiled_cpu_time", "the same in CPU seconds of the process", (">=", 0.98)),
    ("compile_gain_ratio_cpu_time", "the same in CPU seconds of the process", (">=", 0.98)),
    ("loop_vs_handwritten_eager_best", "the same, best run of each variant (least disturbed)", (">=", 0.98)),
    ("loop_vs_handwritten_compiled_best", "the same, best run of each variant (least disturbed)", (">=", 0.98)),
    ("compile_gain_ratio_best", "the same, best run of each variant (least disturbed)", (">=", 0.98)),
    ("host_syncs_per_step", "host syncs per step outside logging steps (counted)", ("<=", 1)),
    ("profile_other_steps_vs_off", "loop speed, profile.steps naming other steps / no profile", (">=", 0.98)),
    ("fsdp2_state_vs_ddp", "training state per rank, fsdp2 / ddp, 2 processes", ("<=", 0.52)),
    ("scaling_2x1_vs_1x1", "tokens/s, 2 processes x 1 thread / 1 x 1 (ideal 2)", None),
    ("fused_decide_vs_per_decision", "step time, one fused all_reduce / one per decision", ("<=", 1.0)),
    ("save_vs_disk", "sync save MiB/s / the disk's fsync write MiB/s", None),
    ("save_vs_memory_copy", "sync save time / a memory copy of the same state", None),
    ("async_blocked_vs_memory_copy", "async save: loop blocked / a memory copy of the state", ("<=", 2.0)),
    ("async_blocked_vs_sync", "async save: loop blocked / a sync save", None),
    ("load_vs_save", "load time / sync save time", None),
    ("startup_vs_import", "command to first optimizer step / import torch, lightning", ("<=", 1.5)),
    ("startup_early_ranks_vs_fabric", "2-process start-up: ranks started before imports / by Fabric", ("<=", 0.9)),
    ("first_step_16gb_vs_1gb", "command to first step, prepared corpus of 16 GB / of 1 GB", ("<=", 1.5)),
    ("first_step_4gb_vs_1gb", "command to first step, prepared corpus of 4 GB / of 1 GB", ("<=", 1.5)),
    ("first_step_verify_full_vs_sizes", "command to first step, 1 GB, data.verify full / sizes (default)", None),
    ("cache_cold_vs_local", "data wait per step, remote folder through an empty cache / local", None),
    ("cache_warm_vs_local", "data wait per step, remote folder through a filled cache / local", None),
    ("adamw_vs_previous_default", "AdamW step time, the project's (fused) / torch's default AdamW", ("<=", 1.0)),
    ("adamw_foreach_vs_previous_default", "AdamW step time, foreach / torch's default AdamW", None),
    ("selective_ac_held_vs_none", "bytes held for backward, selective checkpointing / none", ("<=", 1.0)),
    ("full_ac_held_vs_none", "bytes held for backward, full checkpointing / none", None),
    ("selective_ac_step_vs_full", "forward+backward time, selective checkpointing / full", ("<=", 1.0)),
    ("selective_ac_step_vs_none", "forward+backward time, selective checkpointing / none", None),
    ("full_ac_step_vs_none", "forward+backward time, full checkpointing / none", None),
    ("pipeline_step_vs_ddp", "step time, 2-stage pipeline (1F1B, 4 pieces) / ddp, 2 processes, same batch", None),
    ("pipeline_predicted_step_vs_ddp", "the same as plan's bubble predicts it: 1 / (1 - bubble)", None),
    ("pipeline_zbv_step_vs_ddp", "step time, ZB-V (4 stages in a V on 2 processes, 4 pieces) / ddp, same batch", None),
    ("pipeline_zbv_predicted_step_vs_ddp", "the same as plan's bubble predicts it: 1 / (1 - bubble)", None),
    ("moe_ep2_step_vs_ep1", "step time, cpu-moe-debug at expert parallel 2 / 1, 2 processes, same batch", None),
    ("moe_grouped_vs_loop", "tokens/s through the experts (fwd+bwd), grouped GEMM / loop over experts", (">=", 1.0)),
    ("cp2_held_vs_cp1", "activation bytes held for backward per rank, cp=2 (2 processes) / cp=1", ("<=", 0.55)),
    ("cp2_step_vs_cp1", "step time, cp=2 on 2 processes / cp=1 on 1, the same sequences", None),
    ("goodput_no_failures", "goodput (step time / wall time), 2 processes, no failures", None),
    ("goodput_with_failures", "the same, SIGKILLed every ~25 s, relaunched (resume auto)", None),
    ("goodput_failures_vs_none", "goodput with those failures / without", None),
    ("kills_per_run", "SIGKILLs until the relaunched run was done", None),
    ("restart_vs_fresh_startup", "launch to first step, a restart / a fresh start, same size", ("<=", 1.2)),
    ("redone_steps_vs_save_interval", "steps redone per failure (most in a run) / checkpoint interval", ("<=", 1.0)),
    ("torchrun_goodput_with_failures", "goodput, one worker SIGKILLed every ~25 s, torchrun restarts", None),
    ("torchrun_goodput_failures_vs_none", "goodput with those failures / without", None),
    ("torchrun_kills_per_run", "SIGKILLs until torchrun's run was done", None),
    ("torchrun_restart_vs_fresh_startup", "launch to first step, a torchrun restart / its fresh start", ("<=", 1.2)),
    ("torchrun_redone_steps_vs_save_interval", "steps redone per failure (most) / checkpoint interval", ("<=", 1.0)),
]


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker: the package importable, `threads` threads per process, W&B quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT / "src"), env.get("PYTHONPATH")]))
    env.update({"OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    # Compile in the process: a pool of compile workers would start in the background and share the
    # cores with the timed steps.
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


def run_worker(script: str, *args: str, threads: int = 2, timeout: float = 1200) -> dict[str, Any]:
    """Run benchmarks/<script> with `--json FILE` and return what it wrote."""
    with tempfile.TemporaryDirectory(prefix="bench-") as folder:
        output = Path(folder) / "result.json"
        command = [sys.executable, str(HERE / script), "--json", str(output), *args]
        result = subprocess.run(command, env=worker_env(threads), capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0 or not output.is_file():
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        for line in result.stderr.splitlines():  # the worker's own progress lines
            if line.startswith("  repeat "):
                print(line, file=sys.stderr)
        return json.loads(output.read_text())


def summary(values: list[float]) -> dict[str, Any]:
    """Median and spread of a figure's repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": values}


def loop_figures(quick: bool, repeats: int, steps: int) -> dict[str, dict[str, Any]]:
    """The project's loop against the hand-written one, eager and compiled, per repeat; host syncs per step."""
    result = run_worker("loop.py", "--repeats", str(repeats), "--steps", str(steps), *(["--quick"] if quick else []))
    figures: dict[str, dict[str, Any]] = {}
    for clock, suffix in (("seconds_per_step", ""), ("cpu_seconds_per_step", "_cpu_time")):
        seconds = result[clock]
        variants = ("project_eager", "handwritten_eager", "project_compiled", "handwritten_compiled")
        rounds = list(zip(*(seconds[variant] for variant in variants), strict=True))
        figures[f"loop_vs_handwritten_eager{suffix}"] = summary([he / pe for pe, he, _, _ in rounds])
        figures[f"loop_vs_handwritten_compiled{suffix}"] = summary([hc / pc for _, _, pc, hc in rounds])
        # (the project's compile speed-up) / (the hand-written loop's)
        figures[f"compile_gain_ratio{suffix}"] = summary([(pe / pc) / (he / hc) for pe, he, pc, hc in rounds])
    # On a shared machine a run is either undisturbed or slowed several times over by other work; the
    # best run of each variant is the least disturbed one, so the ratio of the best runs is given too.
    best = {variant: min(values) for variant, values in result["seconds_per_step"].items()}
    figures["loop_vs_handwritten_eager_best"] = summary([best["handwritten_eager"] / best["project_eager"]])
    figures["loop_vs_handwritten_compiled_best"] = summary([best["handwritten_compiled"] / best["project_compiled"]])
    figures["compile_gain_ratio_best"] = summary(
        [
            (best["project_eager"] / best["project_compiled"])
            / (best["handwritten_eager"] / best["handwritten_compiled"])
        ]
    )
    syncs = result["host_syncs_per_step"]
    figures["host_syncs_per_step"] = {**summary([float(count) for count in syncs]), "median": max(syncs)}
    figures["seconds_per_step"] = result["seconds_per_step"]
    return figures


def scaling_figure(quick: bool, repeats: int) -> dict[str, Any]:
    """Tokens/s of 2 processes x 1 thread against 1 x 1 at the same per-process batch, alternating runs."""
    ratios = []
    for _ in range(repeats):
        times = {}
        for devices in (1, 2):
            args = ["--only", "project", "--compile", "eager", "--devices", str(devices), "--threads", "1"]
            args += ["--repeats", "1", "--steps", "12" if quick else "15"]
            times[devices] = run_worker("loop.py", *args, *(["--quick"] if quick else []), threads=1)
        one, two = (times[d]["seconds_per_step"]["project_eager"][0] for d in (1, 2))
        ratios.append(2 * one / two)  # twice the tokens per step on two processes
    return summary(ratios)


def profile_figure(quick: bool, repeats: int) -> dict[str, Any]:
    """Step time without profiling over step time with profile.steps naming a step before the timed window."""
    args = ["--only", "profile", "--compile", "eager", "--repeats", str(repeats), "--steps", "12" if quick else "25"]
    result = run_worker("loop.py", *args, *(["--quick"] if quick else []))
    figures = {}
    for clock in ("seconds_per_step", "cpu_seconds_per_step"):
        times = result[clock]
        figures[clock] = [off / on for off, on in zip(times["project_eager"], times["profiled_eager"], strict=True)]
    cpu_time = summary(figures["cpu_seconds_per_step"])  # less disturbed by other work on a shared machine
    return {
        **summary(figures["seconds_per_step"]),
        "cpu_time": cpu_time,
        "seconds_per_step": result["seconds_per_step"],
    }


def state_figure(quick: bool) -> dict[str, Any]:
    """Bytes of parameters, gradients and optimizer state per rank, fsdp2 against ddp (exact: one run each)."""
    sizes = {
        name: run_worker("state.py", "--strategy", name, *(["--quick"] if quick else [])) for name in ("ddp", "fsdp2")
    }
    ratio = sizes["fsdp2"]["bytes_per_rank"] / sizes["ddp"]["bytes_per_rank"]
    return {**summary([ratio]), "bytes_per_rank": {name: size["bytes_per_rank"] for name, size in sizes.items()}}


def checkpoint_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Sync save against the disk and a memory copy; async save's blocked time; load."""
    # 76 M parameters (872 MiB of FSDP2 state): large enough that a save's per-save fixed work (8-14 ms here) does
    # not stand in for its copy; with 4 x 512 (148 MiB) the async figure was 1.7-2.0x a memory copy.
    size = ["--n_layer", "1", "--n_embd", "64"] if quick else ["--n_layer", "6", "--n_embd", "1024"]
    result = run_worker("checkpoint_io.py", *size, "--repeats", str(repeats), threads=1)
    rows = result["repeats"]

    def ratio(numerator: Callable[[dict], float], denominator: Callable[[dict], float]) -> dict[str, Any]:
        return summary([numerator(row) / denominator(row) for row in rows])

    return {
        "save_vs_disk": ratio(lambda r: r["bytes"] / r["sync_save_s"], lambda r: r["disk_bytes_per_s"]),
        "save_vs_memory_copy": ratio(lambda r: r["sync_save_s"], lambda r: r["memory_copy_s"]),
        "async_blocked_vs_memory_copy": ratio(lambda r: r["async_blocked_s"], lambda r: r["memory_copy_s"]),
        "async_blocked_vs_sync": ratio(lambda r: r["async_blocked_s"], lambda r: r["sync_save_s"]),
        "load_vs_save": ratio(lambda r: r["load_s"], lambda r: r["sync_save_s"]),
        "checkpoint_rounds": {"first_async_blocked_s": result["first_async_blocked_s"], "rounds": rows},
    }


def step_sync_figure(quick: bool, repeats: int) -> dict[str, Any]:
    """The fused per-step decision against one collective per decision, per round."""
    args = ["--rounds", str(max(2, repeats * 2)), "--steps", "3" if quick else "20"]
    rounds = run_worker("step_sync.py", *args, threads=1)["rounds"]
    return summary([row["fused"] / row["per_decision"] for row in rounds])


def training_default_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """AdamW's kernel against torch's default; selective activation checkpointing against full and none."""
    # One thread: a kernel of many small parallel regions (torch's default AdamW on CPU) slows down many times
    # over when a shared machine deschedules one of its threads, which would exaggerate the figure.
    arguments = ["--repeats", str(max(2, repeats)), *(["--quick"] if quick else [])]
    result = run_worker("training_defaults.py", *arguments, threads=1)
    adamw, steps = result["adamw_seconds_per_step"], result["seconds_per_step"]
    held = result["bytes_held_for_backward"]

    def per_repeat(numerator: list[float], denominator: list[float]) -> dict[str, Any]:
        return summary([n / d for n, d in zip(numerator, denominator, strict=True)])

    return {
        "adamw_vs_previous_default": per_repeat(adamw["project"], adamw["torch_default"]),
        "adamw_foreach_vs_previous_default": per_repeat(adamw["foreach"], adamw["torch_default"]),
        "selective_ac_held_vs_none": summary([held["selective"] / held["none"]]),  # counted: one value
        "full_ac_held_vs_none": summary([held["full"] / held["none"]]),
        "selective_ac_step_vs_full": per_repeat(steps["selective"], steps["full"]),
        "selective_ac_step_vs_none": per_repeat(steps["selective"], steps["none"]),
        "full_ac_step_vs_none": per_repeat(steps["full"], steps["none"]),
        "training_defaults": result,
    }


def first_step_probe(argv: list[str]) -> None:
    """Run the command line `argv`; at the end of the first optimizer step print the time and exit."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        print(f"FIRST_STEP {time.time()}", flush=True)
        os._exit(0)

    register_optimizer_step_post_hook(hook)
    sys.argv = [PACKAGE, *argv]
    from importlib import import_module

    import_module(f"{PACKAGE}.cli").main()


def seconds_to_first_step(out_dir: str, *overrides: str) -> float:
    """Seconds from starting `train` (cpu-debug, one process, no logger, no resume) to the end of its first step."""
    train = ["train", "--config", str(PROJECT / "recipes" / "cpu-debug.yaml"), "--devices", "1", "--strategy.name"]
    train += ["ddp", "--out_dir", out_dir, "--logger.name", "none", "--checkpoint.resume", "null", *overrides]
    start = time.time()
    probe = [sys.executable, str(Path(__file__).resolve()), "--first-step-probe", *train]
    result = subprocess.run(probe, env=worker_env(2), capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("FIRST_STEP ")]
    if not lines:
        raise RuntimeError(f"no optimizer step in {' '.join(probe)}:\n{result.stderr[-3000:]}")
    return float(lines[0].split()[1]) - start


def startup_figure(quick: bool, repeats: int) -> dict[str, Any]:
    """Seconds from starting `train` to the end of its first optimizer step, against `import torch, lightning`."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as out_dir:
        ratios, seconds = [], {"import_torch_lightning": [], "to_first_step": []}
        for _ in range(repeats):
            start = time.time()
            subprocess.run([sys.executable, "-c", "import torch, lightning"], env=worker_env(2), check=True)
            imports = time.time() - start
            first_step = seconds_to_first_step(out_dir)
            ratios.append(first_step / imports)
            seconds["import_torch_lightning"].append(imports)
            seconds["to_first_step"].append(first_step)
    return {**summary(ratios), "seconds": seconds}


def logged_startup(out_dir: Path, prestart: str) -> dict[str, float]:
    """The start-up `train` (cpu-debug, 2 processes, 2 steps) logs, in phases, with TRAIN_PRESTART=`prestart`."""
    train = ["train", "--config", str(PROJECT / "recipes" / "cpu-debug.yaml"), "--out_dir", str(out_dir)]
    train += ["--logger.name", "csv", "--logger.log_every_steps", "1", "--checkpoint.resume", "null"]
    train += ["--eval.every_steps", "0", "--checkpoint.save_every_steps", "0", "--train.max_steps", "2"]
    command = [sys.executable, "-m", PACKAGE, *train]
    env = {**worker_env(1), "TRAIN_PRESTART": prestart}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    sys.path.insert(0, str(PROJECT / "src"))
    from {{ cookiecutter.package_name }}.training.goodput import PHASES, STARTUP, phase_key

    (path,) = out_dir.glob("csv/version_*/metrics.csv")
    with path.open() as handle:
        row = next(row for row in csv.DictReader(handle) if row.get(STARTUP))
    return {"startup": float(row[STARTUP]), **{phase: float(row[phase_key(phase)]) for phase in PHASES}}


def early_ranks_figure(repeats: int) -> dict[str, Any]:
    """A 2-process start-up (launch to the first step's end, as the run logs it) with the second rank started
    before the first's imports (cluster/prestart.py) against Fabric's launcher starting it after them."""
    runs: dict[str, list[dict[str, float]]] = {"early": [], "fabric": []}
    with tempfile.TemporaryDirectory(prefix="bench-early-ranks-") as folder:
        for repeat in range(repeats):
            for variant, switch in (("early", "1"), ("fabric", "0")):  # interleaved
                runs[variant].append(logged_startup(Path(folder) / f"{variant}-{repeat}", switch))
    ratios = [early["startup"] / fabric["startup"] for early, fabric in zip(runs["early"], runs["fabric"], strict=True)]
    medians = {
        variant: {key: statistics.median(run[key] for run in done) for key in done[0]} for variant, done in runs.items()
    }
    return {**summary(ratios), "median_seconds": medians}


def logged_step_seconds(out_dir: Path, *overrides: str, recipe: str = "cpu-debug.yaml") -> float:
    """Median seconds per step that `train` (`recipe`, 2 processes, CSV logs) logs after its first 2 steps."""
    train = ["train", "--config", str(PROJECT / "recipes" / recipe), "--out_dir", str(out_dir)]
    train += ["--logger.name", "csv", "--logger.log_every_steps", "1", "--checkpoint.resume", "null"]
    train += ["--eval.every_steps", "0", "--checkpoint.save_every_steps", "0", *overrides]
    command = [sys.executable, "-m", PACKAGE, *train]
    result = subprocess.run(command, env=worker_env(1), capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    import csv

    seconds = []
    for path in out_dir.glob("csv/version_*/metrics.csv"):
        with path.open() as handle:
            rows = csv.DictReader(handle)
            seconds += [
                float(r["time/step_seconds"]) for r in rows if r.get("time/step_seconds") and int(r["step"]) > 2
            ]
    return statistics.median(seconds)


def pipeline_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Step time of a 2-stage 1F1B pipeline (one micro-batch of 8 in 4 pieces), and of ZB-V (4 stages in a V on the
    2 ranks), against ddp (2 x 4), alternating runs, beside the step time plan's bubble predicts for each: under
    1F1B (p - 1) / (m + p - 1) of the step idles, under ZB-V none once 2p - 1 pieces fill the V."""
    sys.path.insert(0, str(PROJECT / "src"))
    from importlib import import_module

    bubble_fraction = import_module(f"{PACKAGE}.planner.pipeline").bubble_fraction
    bubbles = {"pipeline": bubble_fraction("1F1B", 2, 4), "pipeline_zbv": bubble_fraction("ZBVZeroBubble", 2, 4)}
    steps = ["--train.max_steps", "6" if quick else "20"]
    pipeline = ["--train.micro_batch_size", "8", "--strategy.fsdp2.pipeline_parallel_size", "2"]
    pipeline += ["--strategy.fsdp2.pipeline_microbatches", "4"]
    zbv = ["--strategy.fsdp2.pipeline_schedule", "ZBVZeroBubble", "--strategy.fsdp2.pipeline_stages_per_rank", "2"]
    layouts = {"ddp": ["--strategy.name", "ddp"], "pipeline": pipeline, "pipeline_zbv": [*pipeline, *zbv]}
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as folder:
        for repeat in range(repeats):
            for name, overrides in layouts.items():
                seconds[name].append(logged_step_seconds(Path(folder) / f"{name}-{repeat}", *steps, *overrides))
    figures = {}
    for name, bubble in bubbles.items():
        ratios = [piped / ddp for piped, ddp in zip(seconds[name], seconds["ddp"], strict=True)]
        measured = {"ddp": seconds["ddp"], name: seconds[name]}
        figures[f"{name}_step_vs_ddp"] = {**summary(ratios), "seconds_per_step": measured, "bubble": bubble}
        figures[f"{name}_predicted_step_vs_ddp"] = {**summary([1 / (1 - bubble)]), "bubble": bubble}
    return figures


def moe_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """cpu-moe-debug (4 experts, top-2, fsdp2 on 2 processes, the same global batch) with its experts split over the
    2 ranks (tokens exchanged by all-to-all) against every rank holding all 4 (no all-to-all), alternating runs, each
    step's time as the run logs it; and the experts' tokens/s by grouped GEMM against the loop (moe.py, 1 thread)."""
    steps = ["--train.max_steps", "6" if quick else "20"]
    layouts = {
        "ep1": ["--strategy.fsdp2.expert_parallel_size", "1"],
        "ep2": ["--strategy.fsdp2.expert_parallel_size", "2"],
    }
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as folder:
        for repeat in range(repeats):
            for name, overrides in layouts.items():
                out_dir = Path(folder) / f"{name}-{repeat}"
                seconds[name].append(logged_step_seconds(out_dir, *steps, *overrides, recipe="cpu-moe-debug.yaml"))
    experts = run_worker("moe.py", "--repeats", str(repeats), *(["--quick"] if quick else []), threads=1)
    through = experts["tokens_per_second"]
    return {
        "moe_ep2_step_vs_ep1": {
            **summary([two / one for one, two in zip(seconds["ep1"], seconds["ep2"], strict=True)]),
            "seconds_per_step": seconds,
        },
        "moe_grouped_vs_loop": {
            **summary([g / loop for g, loop in zip(through["grouped"], through["loop"], strict=True)]),
            "tokens_per_second": through,
            "shape": experts["shape"],
        },
    }


def sparse_corpus(folder: Path, small: Path, total_bytes: int, shard_bytes: int) -> None:
    """A prepared folder of `total_bytes` of token 0 in sparse shards of `shard_bytes` (no disk used), with the
    tokenizer of `small` (a real prepare) and a manifest that states it, digests included."""
    import hashlib

    manifest = json.loads((small / "manifest.json").read_text())
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((small / "tokenizer.json").read_bytes())
    digest = hashlib.sha256()
    for _ in range(0, shard_bytes, 1 << 20):
        digest.update(bytes(min(1 << 20, shard_bytes)))
    shards, tokens_per_shard = [], shard_bytes // 2  # uint16
    for index in range(total_bytes // shard_bytes):
        name = f"shard-{index:05d}.bin"
        with (folder / name).open("wb") as shard:
            shard.truncate(shard_bytes)
        shards.append({"file": name, "tokens": tokens_per_shard, "sha256": digest.hexdigest()})
    total = tokens_per_shard * len(shards)
    validation = total // 100
    manifest.update(dtype="uint16", shards=shards, tokens=total, documents=1, max_token_id=0)
    manifest["validation"] = {"first_token": total - validation, "tokens": validation, "documents": 0}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def corpus_startup_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Seconds from `train` to its first optimizer step on prepared corpora of 1, 4 and 16 GiB in 1 GiB shards
    (with --quick: 1 and 16 MiB in 256 KiB shards), and on the smallest with data.verify: full (every byte read)."""
    sizes = [1, 16] if quick else [1, 4, 16]
    unit, shard_bytes = (1 << 20, 1 << 18) if quick else (1 << 30, 1 << 30)
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as tmp:
        root = Path(tmp)
        (root / "text").mkdir()
        sys.path.insert(0, str(PROJECT / "src"))
        from importlib import import_module

        demo = import_module(f"{PACKAGE}.tasks.language_model.data").make_demo_text()
        (root / "text" / "demo.txt").write_text(demo)
        prepare = [sys.executable, "-m", PACKAGE, "prepare", str(root / "text"), "--out", str(root / "small")]
        subprocess.run([*prepare, "--train_tokenizer", "300"], env=worker_env(2), check=True, capture_output=True)
        for size in sizes:
            sparse_corpus(root / f"{size}", root / "small", size * unit, shard_bytes)
        seconds: dict[str, list[float]] = {f"{size}": [] for size in sizes} | {"1_verify_full": []}
        for repeat in range(repeats):
            runs = [(f"{size}", root / f"{size}", "sizes") for size in sizes] + [("1_verify_full", root / "1", "full")]
            for key, folder, verify in runs if repeat % 2 == 0 else runs[::-1]:
                data = ["--data.source", "prepared", "--data.path", str(folder), "--data.verify", verify]
                out_dir = str(root / f"run-{key}-{repeat}")
                seconds[key].append(seconds_to_first_step(out_dir, *data, "--model.vocab_size", "512"))
    ratio = lambda a, b: summary([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])  # noqa: E731
    figures = {
        "first_step_16gb_vs_1gb": {**ratio("16", "1"), "seconds": seconds, "bytes_per_gb": unit},
        "first_step_verify_full_vs_sizes": ratio("1_verify_full", "1"),
    }
    return figures if quick else {**figures, "first_step_4gb_vs_1gb": ratio("4", "1")}


def shard_cache_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Data wait per step reading a prepared folder from S3 through the shard cache, cold and warm, / local."""
    result = run_worker("shard_cache.py", "--repeats", str(repeats), *(["--quick"] if quick else []))
    details = {key: result[key] for key in ("seconds_per_step", "shards", "shard_bytes", "steps", "step_ms")}
    return {
        "cache_cold_vs_local": {**summary(result["cold_vs_local"]), **details},
        "cache_warm_vs_local": summary(result["warm_vs_local"]),
    }


def context_parallel_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """cp=2 over 2 processes against whole sequences on 1 process, in alternating repeats: the activations a rank
    holds for backward (counted) and the step time (1 thread a process)."""
    arguments = ["--steps", "3" if quick else "8", *(["--quick"] if quick else [])]
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(repeats):
        for size, results in runs.items():
            results.append(
                run_worker("context_parallel.py", "--context_parallel_size", str(size), *arguments, threads=1)
            )

    def ratios(key: str) -> list[float]:
        return [two[key] / one[key] for one, two in zip(runs[1], runs[2], strict=True)]

    return {
        "cp2_held_vs_cp1": summary(ratios("held_bytes_per_rank")),
        "cp2_step_vs_cp1": summary(ratios("seconds_per_step")),
        "context_parallel": {f"cp{size}": results for size, results in runs.items()},
    }


def goodput_figures(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Goodput of a 2-process run SIGKILLed at seeded moments and resumed (relaunched, and by torchrun's restarts)
    against the same run without failures; a restart's start-up against a fresh start's at the same size (the
    run's own first lifetime); the most steps a failure made the run redo against the checkpoint interval."""
    result = run_worker("goodput.py", "--repeats", str(repeats), *(["--quick"] if quick else []), threads=1)
    runs, save_every = result["runs"], result["settings"]["save_every"]
    figures = {"goodput_no_failures": summary([run["goodput"] for run in runs["none"]])}
    for variant, failed in runs.items():
        if variant == "none":
            continue
        prefix = "" if variant == "relaunch" else f"{variant}_"
        pairs = zip(failed, runs["none"], strict=True)
        figures[f"{prefix}goodput_with_failures"] = summary([run["goodput"] for run in failed])
        figures[f"{prefix}goodput_failures_vs_none"] = summary(
            [run["goodput"] / none["goodput"] for run, none in pairs]
        )
        figures[f"{prefix}kills_per_run"] = summary([float(run["kills"]) for run in failed])
        restarted = [run for run in failed if run["redone_steps"]]  # a run whose kills all missed logs no restart
        if restarted:
            startups = [statistics.median(run["startup_seconds"][1:]) / run["startup_seconds"][0] for run in restarted]
            phases = {"fresh": median_phases(failed, restarts=False), "restart": median_phases(failed, restarts=True)}
            figures[f"{prefix}restart_vs_fresh_startup"] = {**summary(startups), "phase_seconds": phases}
            redone = [max(run["redone_steps"]) / save_every for run in restarted]
            figures[f"{prefix}redone_steps_vs_save_interval"] = summary(redone)
    figures["goodput_runs"] = result
    return figures


def median_phases(runs: list[dict[str, Any]], restarts: bool) -> dict[str, float]:
    """Median seconds of each start-up phase over the runs' fresh starts (their first lifetime), or their restarts."""
    chosen = [phases for run in runs for phases in (run["phase_seconds"][1:] if restarts else run["phase_seconds"][:1])]
    return {phase: statistics.median(p[phase] for p in chosen) for phase in chosen[0]} if chosen else {}


def met(value: float, target: tuple[str, float] | None) -> str:
    if target is None:
        return ""
    comparison, bound = target
    return "yes" if (value >= bound if comparison == ">=" else value <= bound) else "NO"


def table(figures: dict[str, dict[str, Any]]) -> str:
    """The figures as one plain-text table."""
    lines = [f"{'figure':<38} {'median':>8} {'spread':>17}  {'target':>7}  met  what"]
    for key, what, target in FIGURES:
        if key not in figures:
            continue
        value = figures[key]
        spread = f"{value['min']:.3f}..{value['max']:.3f}"
        goal = f"{target[0]} {target[1]:g}" if target else ""
        lines.append(
            f"{key:<38} {value['median']:>8.3f} {spread:>17}  {goal:>7}  {met(value['median'], target):>3}  {what}"
        )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--first-step-probe"]:
        first_step_probe(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, one repeat: a run, not a measurement.")
    parser.add_argument("--repeats", type=int, default=None, help="Interleaved repeats (default 2; --quick: 1).")
    parser.add_argument("--out", default=str(RESULTS), help="JSON file to write.")
    parser.add_argument(
        "--loop_steps", type=int, default=25, help="Steps per loop run, timed from step 5 (40: a longer window)."
    )
    parser.add_argument("--only", default="", help="Comma-separated sections to run (e.g. goodput); default all.")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    started = time.perf_counter()

    figures: dict[str, dict[str, Any]] = {}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("loop", lambda: figures.update(loop_figures(args.quick, repeats, args.loop_steps))),
        ("profile", lambda: figures.update(profile_other_steps_vs_off=profile_figure(args.quick, repeats))),
        ("state", lambda: figures.update(fsdp2_state_vs_ddp=state_figure(args.quick))),
        ("scaling", lambda: figures.update(scaling_2x1_vs_1x1=scaling_figure(args.quick, repeats))),
        ("step sync", lambda: figures.update(fused_decide_vs_per_decision=step_sync_figure(args.quick, repeats))),
        ("checkpoint", lambda: figures.update(checkpoint_figures(args.quick, repeats))),
        ("start-up", lambda: figures.update(startup_vs_import=startup_figure(args.quick, repeats))),
        ("early ranks", lambda: figures.update(startup_early_ranks_vs_fabric=early_ranks_figure(repeats))),
        ("corpus start-up", lambda: figures.update(corpus_startup_figures(args.quick, repeats))),
        ("training defaults", lambda: figures.update(training_default_figures(args.quick, repeats))),
        ("shard cache", lambda: figures.update(shard_cache_figures(args.quick, repeats))),
        ("pipeline", lambda: figures.update(pipeline_figures(args.quick, repeats))),
        ("moe", lambda: figures.update(moe_figures(args.quick, repeats))),
        ("context parallel", lambda: figures.update(context_parallel_figures(args.quick, repeats))),
        ("goodput", lambda: figures.update(goodput_figures(args.quick, repeats))),
    ]
    if args.only:
        sections = [(name, measure) for name, measure in sections if name in args.only.split(",")]
    seconds = {}
    for name, measure in sections:
        section_start = time.perf_counter()
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        measure()
        seconds[name] = time.perf_counter() - section_start

    import torch

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_1min": os.getloadavg()[0],
    }
    report = {
        "command": " ".join(["python", "benchmarks/run.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "quick": args.quick,
        "repeats": repeats,
        "seconds": {**seconds, "total": time.perf_counter() - started},
        "targets": {key: list(target) for key, _, target in FIGURES if target},
        **figures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{report['date']}, {machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}, {report['command']}"
    )
    print(table(figures))
    print(f"({report['seconds']['total']:.0f} s; written to {out})")


if __name__ == "__main__":
    main()
