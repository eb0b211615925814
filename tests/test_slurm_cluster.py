"""The generated SLURM script on a real one-node cluster (Debian's slurm-wlm and munge): a job preempted with
SIGUSR1 saves, requeues itself, resumes, and ends with the weights of a run never interrupted, bitwise."""

from __future__ import annotations

import csv
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import BIN

PACKAGES = "slurmctld slurmd slurm-client munge"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo", "squeue")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
MAX_STEPS = 64
PREEMPT_AFTER_STEP = 3  # the signal is sent once the job's log shows this step
# The cpu-debug recipe with a tiny model, CSV logs, a progress line per step, and no periodic checkpoint: the
# only checkpoint before the end is the one the preemption saves, so the resume can only come from it.
OVERRIDES = [
    "--model.n_layer", "2", "--model.n_embd", "64", "--model.n_head", "2", "--model.block_size", "64",
    "--train.micro_batch_size", "4", "--eval.batches", "2", "--eval.every_steps", "20",
    "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", "0",
    "--logger.name", "csv", "--logger.log_every_steps", "1",
]  # fmt: skip


def tool(name: str) -> str:
    """Path of a SLURM or munge program (daemons live in /usr/sbin, which a user's PATH may lack)."""
    found = shutil.which(name, path=SEARCH_PATH)
    assert found is not None, name
    return found


def require_slurm() -> None:
    """Skip where SLURM is missing and cannot be installed (no apt-get); fail, saying how, where it can be."""
    missing = [name for name in TOOLS if shutil.which(name, path=SEARCH_PATH) is None]
    if missing and shutil.which("apt-get") is None:
        pytest.skip(f"no SLURM on this machine ({', '.join(missing)} missing) and no apt-get to install it")
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: apt-get install -y --no-install-recommends {PACKAGES} (.ci/run does)"
        )
    if os.geteuid() != 0:
        pytest.fail("the one-node SLURM cluster runs its daemons and jobs as root: run this test as root")


def free_port() -> int:
    """A TCP port free on this machine now (the daemons' ports: another cluster may hold SLURM's defaults)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(folder: Path, host: str) -> str:
    """One node (this machine) in one partition; every path in `folder`; no cgroups, no accounting."""
    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return f"""\
ClusterName=template-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder / "munge.socket"}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder / "state"}
SlurmdSpoolDir={folder / "spool"}
SlurmctldPidFile={folder / "slurmctld.pid"}
SlurmdPidFile={folder / "slurmd.pid"}
SlurmctldLogFile={folder / "slurmctld.log"}
SlurmdLogFile={folder / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
KillWait=5
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mib // 2} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A running one-node cluster: its client commands and the environment they (and its jobs) run with."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        environment = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        # A job exports the environment it was submitted from (sbatch's default): this interpreter first on PATH,
        # the cluster's configuration for the `scontrol requeue` of rank 0, and one thread per process, as the
        # uninterrupted run has under Fabric's launcher (CPU kernels sum in another order with another count).
        self.env = {
            **environment,
            "PATH": os.pathsep.join([str(BIN), SEARCH_PATH]),
            "SLURM_CONF": str(folder / "slurm.conf"),
            "OMP_NUM_THREADS": "1",
        }

    def command(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Run a client command (sbatch, scontrol, ...); its output."""
        result = subprocess.run(args, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(args)}: {result.stderr}{self.logs()}"
        return result.stdout

    def output(self, *args: str) -> str:
        """A client command's output, whether or not it succeeded."""
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60).stdout

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as `scontrol show job` gives them (JobState, Reason, Restarts, ExitCode, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.command("scontrol", "-o", "show", "job", job_id)))

    def logs(self) -> str:
        """The end of the daemons' logs, for a failure message."""
        return "".join(
            f"\n--- {name}:\n" + (self.folder / name).read_text()[-1500:]
            for name in ("slurmctld.log", "slurmd.log")
            if (self.folder / name).exists()
        )


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """munged, slurmctld and slurmd of a one-node cluster, configured in a temporary folder with a key of its
    own (nothing under /etc is changed); stopped at the end, failed or not, its jobs cancelled first."""
    require_slurm()
    folder = tmp_path / "slurm"
    (folder / "state").mkdir(parents=True)
    (folder / "spool").mkdir()
    folder.chmod(0o700)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (folder / "slurm.conf").write_text(slurm_conf(folder, socket.gethostname().split(".")[0]))
    cluster = Cluster(folder)
    daemons: list[subprocess.Popen] = []

    def start(*args: str) -> None:
        log = (folder / f"{Path(args[0]).name}.out").open("w")
        daemons.append(subprocess.Popen(args, env=cluster.env, stdout=log, stderr=subprocess.STDOUT))

    try:
        # --force: munged refuses a key and socket under /tmp (writable by all) unless forced.
        start(
            tool("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={folder / 'munge.socket'}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--log-file={folder / 'munged.log'}",
            f"--seed-file={folder / 'munged.seed'}",
        )
        deadline = time.monotonic() + 30
        while not (folder / "munge.socket").exists():
            assert daemons[0].poll() is None and time.monotonic() < deadline, (folder / "munged.out").read_text()
            time.sleep(0.1)
        start(tool("slurmctld"), "-D", "-f", str(folder / "slurm.conf"))
        start(tool("slurmd"), "-D", "-f", str(folder / "slurm.conf"))
        deadline = time.monotonic() + 60
        while "idle" not in cluster.output("sinfo", "-h", "-N", "-o", "%T"):
            assert all(daemon.poll() is None for daemon in daemons), cluster.logs()
            assert time.monotonic() < deadline, "the node did not come up within 60 s" + cluster.logs()
            time.sleep(0.5)
        yield cluster
    finally:
        # Job processes run under slurmstepd, which outlives slurmd: cancel every job and wait for it to end.
        if daemons and all(daemon.poll() is None for daemon in daemons):
            if jobs := cluster.output("squeue", "-h", "-o", "%i").split():
                cluster.output("scancel", *jobs)
            deadline = time.monotonic() + 30
            while cluster.output("squeue", "-h").strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def losses(out_dir: Path) -> dict[int, str]:
    """step -> the training loss as the CSV logs wrote it, over every run into out_dir."""
    rows = [row for path in sorted(out_dir.glob("csv/version_*/metrics.csv")) for row in csv.DictReader(path.open())]
    return {int(row["step"]): row["train/loss"] for row in rows if row.get("train/loss")}


def project_command(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m my_project ARGS` of the generated project (not installed: PYTHONPATH names its src)."""
    return subprocess.run(
        [sys.executable, "-m", "my_project", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def final_weights(out_dirs: list[Path], env: dict[str, str]) -> list[dict[str, torch.Tensor]]:
    """The model tensors of each run's checkpoint of step MAX_STEPS, by the project's `checkpoint consolidate`
    (one process per run, side by side: most of their time is importing)."""
    outputs = [out_dir.parent / f"{out_dir.name}.pt" for out_dir in out_dirs]
    checkpoints = [out_dir / "checkpoints" / f"step-{MAX_STEPS:08d}" for out_dir in out_dirs]
    command = [sys.executable, "-m", "my_project", "checkpoint", "consolidate"]
    consolidations = [
        subprocess.Popen([*command, str(checkpoint), str(output)], env=env, stderr=subprocess.PIPE, text=True)
        for checkpoint, output in zip(checkpoints, outputs, strict=True)
    ]
    for consolidation in consolidations:
        _, stderr = consolidation.communicate(timeout=600)
        assert consolidation.returncode == 0, stderr[-3000:]
    return [torch.load(output, weights_only=True) for output in outputs]


def test_slurm_job_preempted_with_usr1_requeues_itself_and_ends_bitwise_equal_to_an_uninterrupted_run(
    default_project: Path, slurm_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = slurm_cluster
    env = {**cluster.env, "PYTHONPATH": str(default_project / "src"), "WANDB_MODE": "offline"}
    recipe = default_project / "recipes" / "cpu-debug.yaml"
    job_dir = tmp_path / "job"
    (job_dir / "logs").mkdir(parents=True)  # the script's --output=logs/%x-%j.out, relative to where sbatch runs
    slurm_args = ["slurm", str(recipe), "--time", "0:10:00", "--cpus_per_task", "1", "--job_name", "preempted"]
    written = project_command(env, job_dir, *slurm_args)
    assert written.returncode == 0, written.stderr
    (job_dir / "job.sbatch").write_text(written.stdout)
    assert "#SBATCH --ntasks-per-node=2" in written.stdout and "#SBATCH --requeue" in written.stdout

    with_overrides = ["job.sbatch", "--out_dir", str(tmp_path / "preempted"), *OVERRIDES]
    job_id = cluster.command("sbatch", "--parsable", *with_overrides, cwd=job_dir, env=env).strip().split(";")[0]
    log = job_dir / "logs" / f"preempted-{job_id}.out"

    def log_text() -> str:
        return log.read_text() if log.exists() else ""

    deadline = time.monotonic() + 180
    for polls in itertools.count():
        if f"step {PREEMPT_AFTER_STEP}/{MAX_STEPS}" in log_text():
            break
        if polls % 20 == 0:  # the job's state every 2 s: each look is a client process, taking CPU from the job
            assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), log_text()[-3000:] + cluster.logs()
        assert time.monotonic() < deadline, "no training step logged within 180 s\n" + log_text()[-3000:]
        time.sleep(0.1)
    cluster.command("scancel", "-s", "USR1", job_id)  # to the job's tasks (not the batch shell), as --signal does

    deadline = time.monotonic() + 240
    while (job := cluster.job(job_id))["JobState"] != "COMPLETED":
        assert job["JobState"] in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"), log_text()[-3000:] + str(job)
        assert time.monotonic() < deadline, "the job did not finish within 240 s\n" + log_text()[-3000:] + str(job)
        if job["Reason"] == "BeginTime":
            # SLURM holds a requeued job back until its step credentials expire (AuthInfo cred_expire, 120 s by
            # default); the node is free again at once here, so it may start now.
            cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(1)
    assert job["ExitCode"] == "0:0" and job["Restarts"] == "1", job

    text = log_text()
    preempted = re.search(r"preempted by SIGUSR1 at step (\d+)", text)
    assert preempted and f"requeued SLURM job {job_id}" in text, text[-5000:]
    step = int(preempted.group(1))
    assert PREEMPT_AFTER_STEP <= step < MAX_STEPS
    assert f"Resumed from {tmp_path / 'preempted' / 'checkpoints' / f'step-{step:08d}'} at step {step}" in text
    assert f"Done at step {MAX_STEPS}" in text

    # The same recipe and overrides as the job's (its script adds the layout and resume auto), without SLURM.
    layout = ["--num_nodes", "1", "--devices", "2", "--checkpoint.resume", "auto"]
    out_dir = ["--out_dir", str(tmp_path / "uninterrupted")]
    uninterrupted = project_command(env, job_dir, "train", "--config", str(recipe), *layout, *out_dir, *OVERRIDES)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]

    expected = losses(tmp_path / "uninterrupted")
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    assert losses(tmp_path / "preempted") == expected  # each step's loss before and after the requeue, exactly
    weights, expected_weights = final_weights([tmp_path / "preempted", tmp_path / "uninterrupted"], env)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
