"""DeepSpeed ZeRO 1-3 run for real on 2 CPU processes (DeepSpeed's CPU accelerator, gloo) through the same loop.

Fabric refuses DeepSpeedStrategy on CPU, so these runs go through tests/deepspeed_on_cpu.py, which
lifts only that restriction. Every run is compared with a ddp run of the same seed and global batch:
ZeRO shards the same computation, so the losses must agree, with gradient accumulation, across a
kill and resume, and when a NaN loss makes every rank skip an update.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import PROJECT, losses_by_run, read_csv_metrics, run_cli, train_args

pytestmark = pytest.mark.slow

STEPS = 6
# Global batch 8 = 2 processes x micro-batch 2 x 2 accumulated micro-batches.
COMMON = [
    "--train.micro_batch_size", "2", "--train.grad_accum_steps", "2", "--train.max_steps", str(STEPS),
    "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
]  # fmt: skip
ZERO = {
    "zero1": ["--strategy.deepspeed.stage", "1"],
    "zero2": ["--strategy.deepspeed.stage", "2"],
    "zero3": ["--strategy.deepspeed.stage", "3"],
    "zero2_offload": ["--strategy.deepspeed.stage", "2", "--strategy.deepspeed.offload_optimizer", "cpu"],
    "zero1_bf16": ["--strategy.deepspeed.stage", "1", "--precision", "bf16-mixed"],
    "zero3_bf16": ["--strategy.deepspeed.stage", "3", "--precision", "bf16-mixed"],
    "zero3_offload": [
        "--strategy.deepspeed.stage", "3", "--strategy.deepspeed.offload_optimizer", "cpu", "--strategy.deepspeed.offload_parameters", "cpu",
    ],
}  # fmt: skip
TOLERANCE = 1e-5  # the same computation; ZeRO-3 reduce-scatters where ddp all-reduces (summation order)


def deepspeed(out_dir: Path, zero: str, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    """The command line under tests/deepspeed_on_cpu.py with strategy.name=deepspeed and a ZeRO setup."""
    args = train_args(out_dir, *COMMON, "--strategy.name", "deepspeed", *ZERO[zero], *extra)
    return run_cli(*args, fault=fault, script=PROJECT / "tests" / "deepspeed_on_cpu.py")


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    for warning in ("does not support skipping the gradient synchronization", "collide with DeepSpeed"):
        assert warning not in result.stderr  # accumulation and the checkpoint's keys are handled, not warned about
    return result


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Losses of the ddp runs every DeepSpeed run is compared with (plain, and with a NaN at step 3 skipped),
    and the plain run's gradient norms."""
    losses = {}
    for name, fault in (("plain", ""), ("nan_skipped", "nan-at-step:3")):
        out_dir = tmp_path_factory.mktemp(f"ddp_{name}")
        args = train_args(out_dir, *COMMON, "--strategy.name", "ddp", "--train.on_nonfinite_loss", "skip")
        result = run_cli(*args, fault=fault)
        assert result.returncode == 0, result.stderr[-3000:]
        (losses[name],) = losses_by_run(out_dir)
        if name == "plain":
            rows = read_csv_metrics(out_dir)
            losses["grad_norms"] = [float(row["train/grad_norm"]) for row in rows if row.get("train/loss")]
    return losses


def assert_close(losses: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(losses) == sorted(expected)
    for step, loss in losses.items():
        if expected[step] != expected[step]:  # NaN: the skipped step's loss is logged as it was
            assert loss != loss
        else:
            assert loss == pytest.approx(expected[step], abs=TOLERANCE), f"step {step}: {losses} vs {expected}"


@pytest.mark.parametrize("zero", ["zero1", pytest.param("zero2", marks=pytest.mark.matrix), "zero3"])
def test_zero_stages_with_gradient_accumulation_train_like_ddp(tmp_path: Path, ddp: dict, zero: str) -> None:
    succeeded(deepspeed(tmp_path, zero))
    (losses,) = losses_by_run(tmp_path)
    assert_close(losses, ddp["plain"])
    # The gradient norm DeepSpeed clips with is logged, and it is ddp's.
    norms = [float(row["train/grad_norm"]) for row in read_csv_metrics(tmp_path) if row.get("train/loss")]
    assert norms == pytest.approx(ddp["grad_norms"], rel=1e-4)


@pytest.mark.parametrize("zero", [pytest.param("zero2_offload", marks=pytest.mark.matrix), "zero3_offload"])
def test_a_killed_zero_run_with_cpu_offload_resumes_where_it_stopped(tmp_path: Path, ddp: dict, zero: str) -> None:
    killed = deepspeed(tmp_path, zero, fault="kill-at-step:4")  # SIGKILL of the whole job after step 4's save
    assert killed.returncode != 0
    resumed = succeeded(deepspeed(tmp_path, zero, "--checkpoint.resume", "auto"))
    assert "at step 4" in resumed.stdout and "Resumed from" in resumed.stdout
    before, after = losses_by_run(tmp_path)
    assert_close(before, {step: ddp["plain"][step] for step in range(1, 5)})
    assert_close(after, {step: ddp["plain"][step] for step in range(5, STEPS + 1)})
    assert (tmp_path / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").is_file()


@pytest.mark.parametrize("zero", ["zero1_bf16", pytest.param("zero3_bf16", marks=pytest.mark.matrix)])
def test_a_killed_bf16_zero_run_resumes_to_the_losses_of_an_uninterrupted_one(tmp_path: Path, zero: str) -> None:
    # DeepSpeed keeps bf16 weights with fp32 master copies (its own bf16 optimizer under ZeRO-1): not ddp's numerics,
    # so the reference is the same setup run without interruption.
    succeeded(deepspeed(tmp_path / "uninterrupted", zero))
    (expected,) = losses_by_run(tmp_path / "uninterrupted")
    assert deepspeed(tmp_path / "killed", zero, fault="kill-at-step:4").returncode != 0
    succeeded(deepspeed(tmp_path / "killed", zero, "--checkpoint.resume", "auto"))
    before, after = losses_by_run(tmp_path / "killed")
    assert before == {step: expected[step] for step in range(1, 5)}
    assert after == {step: expected[step] for step in range(5, STEPS + 1)}


@pytest.mark.parametrize("zero", [pytest.param("zero2", marks=pytest.mark.matrix), "zero3"])
def test_a_nan_loss_skips_the_update_on_every_rank_and_the_count_survives_a_resume(
    tmp_path: Path, ddp: dict, zero: str
) -> None:
    skip = ("--train.on_nonfinite_loss", "skip")
    succeeded(deepspeed(tmp_path, zero, *skip, "--checkpoint.resume", "null", fault="nan-at-step:3"))
    (losses,) = losses_by_run(tmp_path)
    assert_close(losses, ddp["nan_skipped"])  # ZeRO-3 would go wrong at step 5 had its gradients been kept
    # Resumed from step 6, a second NaN is the second skipped update: the count was saved and restored.
    more = ("--train.max_steps", str(STEPS + 2), "--checkpoint.resume", "auto")
    succeeded(deepspeed(tmp_path, zero, *skip, *more, fault=f"nan-at-step:{STEPS + 1}"))
    skipped = [
        float(row["train/skipped_updates"]) for row in read_csv_metrics(tmp_path) if row.get("train/skipped_updates")
    ]
    assert skipped == [1.0, 2.0]
