"""What the tests share: the command line run as a user runs it, one builder of `train` arguments, and readers
of what a run wrote. Test files import from here (`from helpers import ...`)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import resource
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.package_name }}"
RECIPES = PROJECT / "recipes"
# A library recipe of 4 nodes x 8 GPUs under fsdp2 (the SLURM and submitit tests write its job scripts).
MULTINODE = "{% if cookiecutter.task == "language_model" %}fsdp2-multinode{% else %}vit-l16-fsdp2-multinode{% endif %}"

# A model and run small enough for 2 CPU cores; every e2e test starts from cpu-debug plus these.
{%- if cookiecutter.task == "language_model" %}
TINY = [
    "--model.n_layer",
    "2",
    "--model.n_embd",
    "64",
    "--model.n_head",
    "2",
    "--model.block_size",
    "64",
    "--train.micro_batch_size",
    "4",
    "--eval.batches",
    "2",
    "--logger.log_every_steps",
    "1",
]
{%- else %}
# One 8x8 patch per digit, and a higher learning rate: the e2e tests that check learning see it within 30 steps
# (with 2x2 patches the class token starts as an average of the patches, and the loss stays near ln 10 for
# the first ~100 steps).
TINY = [
    "--model.n_layer",
    "2",
    "--model.n_embd",
    "32",
    "--model.n_head",
    "2",
    "--model.patch_size",
    "8",
    "--train.learning_rate",
    "0.01",
    "--train.warmup_steps",
    "2",
    "--train.micro_batch_size",
    "4",
    "--eval.batches",
    "2",
    "--logger.log_every_steps",
    "1",
]
{%- endif %}
# Two pipeline stages on the 2 processes of cpu-debug or toy-debug: one data-parallel rank's micro-batch of 8 samples,
# fed through in 4 pieces.
PIPELINE = [
    "--strategy.name", "fsdp2", "--strategy.fsdp2.pipeline_parallel_size", "2",
    "--strategy.fsdp2.pipeline_microbatches", "4", "--train.micro_batch_size", "8",
]  # fmt: skip
UNIT = "{% if cookiecutter.task == "language_model" %}token{% else %}image{% endif %}"  # what throughput counts


def logged_metrics(unit: str) -> set[str]:
    """What every run of a task that counts `unit` logs with any logger, beside its own validation metrics (CPU runs:
    no GPU memory figures)."""
    return {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        f"throughput/{unit}s_per_second",
        f"throughput/{unit}s_per_second_per_device",
        "throughput/samples_per_second",
        "throughput/samples_per_second_per_device",
        f"throughput/flops_per_{unit}",
        "throughput/tflops_per_second_per_device",
        "throughput/mfu",
        "memory/host_peak_rss_gib",
        "time/data_wait_seconds",
        "time/data_wait_fraction",
        "time/checkpoint_save_seconds",
        "val/loss",
    }


# What every run of the project's task logs with any logger.
LOGGED_METRICS = logged_metrics(UNIT) | {"val/{% if cookiecutter.task == "language_model" %}perplexity{% else %}accuracy{% endif %}"}


def cli_env(source: Path | None = None) -> dict[str, str]:
    """Environment for a CLI subprocess: the package (and, for scripts run from tests/, these helpers) importable,
    W&B offline and quiet. `source`: a copy of src/ to import the package from instead (`with_task_package`)."""
    env = dict(os.environ)
    paths = [str(source or PROJECT / "src"), str(PROJECT / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"})
    # W&B gives up starting its service after 90 s; a loaded 2-core machine can take longer than that.
    env.setdefault("WANDB_INIT_TIMEOUT", "600")
    env.pop("WANDB_API_KEY", None)
    # A W&B run in this test process (tests/unit/test_observe.py) leaves WANDB_SERVICE naming its own service;
    # a training run that inherits it talks to that service instead of starting its own, and its ranks fail.
    env.pop("WANDB_SERVICE", None)
    return env


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 600,
    fault: str = "",
    script: Path | None = None,
    source: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m <package> ARGS` (or `python SCRIPT ARGS`) in its own session, so an injected fault kills
    only it; capture its output. `source`: a copy of src/ to run instead (`with_task_package`)."""
    env = cli_env(source)
    if fault:
        env["TRAIN_FAULT"] = fault
    return subprocess.run(
        [sys.executable, *([str(script)] if script else ["-m", PACKAGE]), *args],
        cwd=cwd or PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def read_csv_metrics(out_dir: Path) -> list[dict[str, str]]:
    """Rows of every CSV metrics file a run wrote, in version order."""
    rows: list[dict[str, str]] = []
    for path in sorted(out_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as handle:
            rows.extend(csv.DictReader(handle))
    return rows


def losses_by_run(out_dir: Path) -> list[dict[int, float]]:
    """step -> training loss, one dict per run (CSV version) into out_dir."""
    runs = []
    for path in sorted(out_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as handle:
            runs.append({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r.get("train/loss")})
    return runs


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> logged training loss, over all runs into out_dir."""
    return {int(row["step"]): float(row["train/loss"]) for row in read_csv_metrics(out_dir) if row.get("train/loss")}


def run_overrides(out_dir: Path, *overrides: str) -> list[str]:
    """Overrides of a recipe: the TINY model and CSV logs in out_dir, then the test's own overrides."""
    return [*TINY, "--out_dir", str(out_dir), "--logger.name", "csv", *overrides]


def recipe_args(out_dir: Path, *overrides: str) -> list[str]:
    """The cpu-debug recipe with the TINY model and CSV logs in out_dir, then the test's own overrides."""
    return ["--config", str(RECIPES / "cpu-debug.yaml"), *run_overrides(out_dir, *overrides)]


def train_args(out_dir: Path, *overrides: str) -> list[str]:
    """`train` arguments of the command line: `recipe_args` after the subcommand."""
    return ["train", *recipe_args(out_dir, *overrides)]


# The toy task of tests/toy_task/: what the machinery's own tests train, in every project whatever its task.
TOY_TASK = "vector_regression"
TOY_RECIPE = PROJECT / "tests" / "toy-debug.yaml"


def with_task_package(folder: Path, name: str, target: Path) -> Path:
    """A copy of the project's src/ at `target` with the task package `folder` added as tasks/<name>/ (its imports
    of the project made relative, as a task written inside the package has them), nothing else touched; returns
    `target`."""
    import re
    import shutil

    shutil.copytree(PROJECT / "src", target, ignore=shutil.ignore_patterns("__pycache__"))
    package = target / PACKAGE / "tasks" / name
    package.mkdir()
    for module in sorted(folder.glob("*.py")):
        text = re.sub(rf"^from {PACKAGE}\.", "from ...", module.read_text(), flags=re.M)
        (package / module.name).write_text(text)
    return target


def toy_train_args(out_dir: Path, *overrides: str) -> list[str]:
    """`train` of the toy task's recipe (tests/toy-debug.yaml) with CSV logs in out_dir, then the test's overrides."""
    return ["train", "--config", str(TOY_RECIPE), "--out_dir", str(out_dir), "--logger.name", "csv", *overrides]


# Runs the command line with the named modules unimportable, as on a machine without them.
WITHOUT_MODULES = f"""
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # any import of it now raises ImportError
sys.argv = ["{PACKAGE}", *sys.argv[2:]]
from {PACKAGE}.cli import main
main()
"""


def run_cli_without(modules: tuple[str, ...], *args: str, source: Path | None = None) -> subprocess.CompletedProcess:
    """Run the command line where `modules` (torch, submitit, ...) cannot be imported; capture its output.
    `source`: a copy of src/ to run instead (`with_task_package`)."""
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_MODULES, ",".join(modules), *args],
        cwd=PROJECT,
        env=cli_env(source),
        capture_output=True,
        text=True,
    )


def fail_with(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in-process, assert exit code 2 and a one-line error; return that line."""
    from {{ cookiecutter.package_name }}.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def assert_one_line_refusal(code: int, stderr: str, message: str) -> None:
    """Exit code 2 and one line on stderr, `error: ...` holding `message`, no traceback."""
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    assert "Traceback" not in stderr
    assert message in stderr, stderr


# Runs every case in one process in which `import torch` fails: each must be refused before it.
REFUSE_WITHOUT_TORCH = f"""
import contextlib, io, json, sys, time
sys.modules["torch"] = None  # any import of torch now raises ImportError
from {PACKAGE}.cli import main

results = dict()
for case in json.load(open(sys.argv[1])):
    err = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(case["argv"])
            code = 0
        except SystemExit as exited:
            code = exited.code
        except BaseException as error:  # an import of torch, or a traceback: both fail the case
            code, err = -1, io.StringIO(type(error).__name__ + ": " + str(error))
    results[case["id"]] = dict(code=code, stderr=err.getvalue(), seconds=time.perf_counter() - started)
print(json.dumps(results))
"""


def outcomes_without_torch(cases: dict[str, list[str]], folder: Path, source: Path | None = None) -> dict[str, dict]:
    """case id -> {code, stderr, seconds} of each command line `cases[id]`, all run in one process where torch
    cannot be imported (one process: the cases cost the package's import once). `source`: as for `run_cli`."""
    listing = folder / "cases.json"
    listing.write_text(json.dumps([{"id": case_id, "argv": argv} for case_id, argv in cases.items()]))
    result = subprocess.run(
        [sys.executable, "-c", REFUSE_WITHOUT_TORCH, str(listing)], env=cli_env(source), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def folder_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder (empty when it does not exist)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def assert_refused_before_launch(
    args: list[str], message: str, out_dir: Path, home: Path, source: Path | None = None, **environment: str
) -> None:
    """`python -m <package> ARGS` (with `environment` set) is refused in one line holding `message` within 10 CPU
    seconds, and leaves out_dir and `home` (the test's folder, its HOME) as they were: nothing written or changed."""
    watched = (out_dir, home)
    before = {path: folder_hashes(path) for path in watched}
    env = {**cli_env(source), "HOME": str(home), **environment}  # no ~/.netrc: no W&B login
    # matplotlib (imported by torchmetrics when installed) keeps a font cache under HOME: not the run's writing.
    env["MPLCONFIGDIR"] = tempfile.mkdtemp()
    before_run = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [sys.executable, "-m", PACKAGE, *args], env=env, capture_output=True, text=True, timeout=120
    )
    # The refusal's CPU seconds (importing torch is most of them): wall time on a shared machine measures its load.
    after_run = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after_run.ru_utime - before_run.ru_utime) + (after_run.ru_stime - before_run.ru_stime) < 10
    assert_one_line_refusal(result.returncode, result.stderr, message)
    assert {path: folder_hashes(path) for path in watched} == before  # nothing written, nothing changed
    if not before[out_dir]:
        assert not out_dir.is_dir()


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    """The plan of a command line (`plan ARGS --json`, in-process), as JSON."""
    from {{ cookiecutter.package_name }}.cli import main

    main(["plan", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def recommended(capsys: pytest.CaptureFixture[str], *args: str) -> str | None:
    """The strategy `plan` recommends for a command line, or None when nothing fits."""
    plan = plan_json(capsys, *args)
    return plan["recommended"] and plan["recommended"]["strategy"]


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous over loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def final_weights(out_dir: Path, max_steps: int) -> dict[str, torch.Tensor]:
    """The weights of a run's last checkpoint, which must be that of step max_steps."""
    from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest
    from {{ cookiecutter.package_name }}.checkpoint.load import consolidate

    latest = find_latest(out_dir / "checkpoints")
    assert latest is not None and latest.name == f"step-{max_steps:08d}"
    return consolidate(latest, out_dir / "weights.pt", force=True)  # read again by a later assertion


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same tensors, bitwise."""
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def executable(path: Path, text: str) -> None:
    """Write a script (a stub of srun or scontrol) and make it executable."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_nodes(args: list[str], nodes: int, source: Path | None = None) -> None:
    """Run the CLI once per node, as a multi-node launch does, with a real rendezvous over loopback."""
    if nodes == 1:
        result = run_cli(*args, source=source)
        assert result.returncode == 0, result.stderr[-3000:]
        return
    port = str(free_port())
    launches = []
    for node_rank in range(nodes):
        env = {**cli_env(source), "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, "-m", PACKAGE, *args]
        launches.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for launch in launches:
        _, stderr = launch.communicate(timeout=600)
        assert launch.returncode == 0, stderr[-3000:]


def train_each_layout_once(
    tmp_path_factory: pytest.TempPathFactory,
    layouts: dict[str, tuple[list[str], int]],
    shared: list[str],
    arguments: Callable[..., list[str]] = train_args,
    source: Path | None = None,
) -> Callable[[str], Path]:
    """name -> out_dir of the run of layouts[name] = (overrides, nodes) after `shared`; each trains once.
    `arguments(out_dir, *overrides)`: the command line (the project's cpu-debug, or `toy_train_args` with `source`)."""
    done: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in done:
            out_dir = tmp_path_factory.mktemp(name)
            overrides, nodes = layouts[name]
            run_nodes(arguments(out_dir, *shared, *overrides), nodes, source)
            done[name] = out_dir
        return done[name]

    return run


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], tolerance: float) -> None:
    """The same steps, each loss within `tolerance`."""
    assert sorted(actual) == sorted(expected)
    for step, loss in expected.items():
        assert abs(actual[step] - loss) <= tolerance, f"step {step}: {actual[step]} vs {loss}"


def process_alive(pid: int) -> bool:
    """Whether a process runs (not gone, not a zombie waiting for its parent to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(status.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if parent == pid:
            found.append(int(status.parent.name))
    return found
