"""Real multi-process runs on CPU (gloo): every strategy that runs on CPU trains the same model to the same losses.

Same seed, same global batch (8 vectors = micro_batch_size x data-parallel ranks): ddp, FSDP2,
HSDP, tensor parallel and FSDP2 + tensor parallel are the same computation spread differently.
The machinery's own test: it trains the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import (
    PACKAGE,
    assert_same_losses,
    cli_env,
    final_weights,
    run_cli,
    toy_train_args,
    train_each_layout_once,
    train_losses,
)
from toy_task.model import Mlp
from toy_task.task import MlpConfig

from {{ cookiecutter.package_name }}.precision import torch_model_states

pytestmark = pytest.mark.slow

STEPS = 4
# name -> (overrides of tests/toy-debug.yaml, nodes): every layout has a global batch of 8 vectors.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (["--strategy.name", "ddp"], 1),  # 2 processes x 4
    "fsdp2": ([], 1),  # 2 processes x 4
    "tp": (
        ["--strategy.fsdp2.tensor_parallel_size", "2", "--train.micro_batch_size", "8"],
        1,
    ),  # 1 data-parallel rank x 8
    "fsdp2_tp": (["--devices", "4", "--strategy.fsdp2.tensor_parallel_size", "2"], 1),  # 2 (x 2 tensor parallel) x 4
    # 2 nodes x 2 x 1 x 2 micro-batches: each reduce-scattered, the replicas' all-reduce once a step
    "hsdp": (
        [
            "--strategy.name",
            "hsdp",
            "--num_nodes",
            "2",
            "--train.micro_batch_size",
            "1",
            "--train.grad_accum_steps",
            "2",
        ],
        2,
    ),
    "fsdp2_checkpointing_compile": (
        [
            "--strategy.activation_checkpointing",
            "true",
            "--strategy.activation_checkpointing_every",
            "2",
            "--strategy.compile",
            "true",
        ],
        1,
    ),
    "fsdp2_selective_checkpointing": (
        ["--strategy.activation_checkpointing", "true", "--strategy.activation_checkpointing_policy", "selective"],
        1,
    ),
    "fsdp2_meta_init": (["--strategy.meta_init", "true"], 1),
}


SHARED = [
    "--train.max_steps", str(STEPS), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
    "--checkpoint.resume", "null",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> Callable[[str], Path]:
    """name -> out_dir of that layout's run; each layout trains once per test session."""
    return train_each_layout_once(tmp_path_factory, LAYOUTS, SHARED, toy_train_args, toy_source)


def test_ddp_fsdp2_hsdp_and_tensor_parallel_give_the_same_losses(trained: Callable[[str], Path]) -> None:
    reference = train_losses(trained("ddp"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1]
    for name in ("fsdp2", "hsdp", "tp", "fsdp2_tp"):
        assert_same_losses(train_losses(trained(name)), reference, tolerance=1e-4)


def test_hsdp_saves_one_shard_per_rank_of_both_nodes(trained: Callable[[str], Path]) -> None:
    state = trained("hsdp") / "checkpoints" / f"step-{STEPS:08d}" / "state"
    assert len(list(state.glob("*.distcp"))) == 4
    assert json.loads((state.parent / "meta.json").read_text())["world_size"] == 4


def test_fsdp2_with_tensor_parallel_resumes_to_the_losses_of_an_uninterrupted_run(
    trained: Callable[[str], Path], tmp_path: Path, toy_source: Path
) -> None:
    uninterrupted = trained("fsdp2_tp")
    overrides, _ = LAYOUTS["fsdp2_tp"]
    checkpoint = uninterrupted / "checkpoints" / "step-00000002"
    resume = ["--checkpoint.resume", str(checkpoint)]
    result = run_cli(*toy_train_args(tmp_path, *SHARED, *overrides), *resume, source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {checkpoint} at step 2" in result.stdout
    expected = {step: loss for step, loss in train_losses(uninterrupted).items() if step > 2}
    assert_same_losses(train_losses(tmp_path), expected, tolerance=1e-5)


def test_full_and_selective_activation_checkpointing_and_compile_do_not_change_the_losses(
    trained: Callable[[str], Path],
) -> None:
    assert_same_losses(
        train_losses(trained("fsdp2_checkpointing_compile")), train_losses(trained("fsdp2")), tolerance=1e-4
    )
    assert_same_losses(
        train_losses(trained("fsdp2_selective_checkpointing")), train_losses(trained("fsdp2")), tolerance=1e-4
    )


def test_meta_device_init_materialises_a_sharded_model_that_learns(trained: Callable[[str], Path]) -> None:
    losses = train_losses(trained("fsdp2_meta_init"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    # The model's own init (init_parameter: LayerNorm scales at one, weights ~ N(0, 0.1)), not memory left as it was:
    # each rank draws its own shards, so the first loss is near an ordinary build's, not equal to it.
    ordinary = train_losses(trained("ddp"))
    assert abs(losses[1] - ordinary[1]) < 0.25 * ordinary[1]
    weights = final_weights(trained("fsdp2_meta_init"), STEPS)
    scales = [weights[f"blocks.{index}.norm.weight"] for index in range(3)]
    assert all(bool(((scale - 1).abs() < 0.1).all()) for scale in scales)  # 4 small steps away from one
    assert losses[STEPS] < losses[1]


MEASURE = """
import json, sys
from pathlib import Path
from {package}.errors import exit_process
from {package}.tasks.base import batch_loss
from {package}.training.memory import local_training_state_bytes
from {package}.recipe.load import parse_recipe
from {package}.training.run import setup

run = setup(parse_recipe(sys.argv[1:]))
batch = run.fabric.to_device(run.task.datasets().train.batch([0, 1]))
run.fabric.backward(batch_loss(run.task, run.model, batch).objective)
run.optimizer.step()
measured = local_training_state_bytes(run.model, run.optimizer)
# One file per rank: two processes printing to one pipe at the same moment can interleave their lines.
Path("{reports}", "rank-%d.json" % run.fabric.global_rank).write_text(json.dumps(measured))
run.fabric.barrier()
exit_process(0)  # as the command line ends: leave the process group, skip interpreter teardown
"""


def training_state_bytes(strategy: str, tmp_path: Path, source: Path) -> list[int]:
    """Per-rank bytes of parameters + gradients + optimizer state after one step with 2 processes."""
    script, reports = tmp_path / f"measure_{strategy}.py", tmp_path / f"reports_{strategy}"
    reports.mkdir()
    script.write_text(MEASURE.format(package=PACKAGE, reports=reports))
    _, *args = toy_train_args(tmp_path / f"run_{strategy}", "--strategy.name", strategy, "--checkpoint.resume", "null")
    args += ["--logger.name", "none"]
    result = subprocess.run(
        [sys.executable, str(script), *args], env=cli_env(source), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    assert sorted(path.name for path in reports.iterdir()) == ["rank-0.json", "rank-1.json"]
    by_rank = [json.loads((reports / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(report["gradients"] > 0 and report["optimizer"] > 0 for report in by_rank)
    return [sum(report.values()) for report in by_rank]


def test_fsdp2_holds_about_half_of_ddps_training_state_per_rank(tmp_path: Path, toy_source: Path) -> None:
    ddp, fsdp2 = training_state_bytes("ddp", tmp_path, toy_source), training_state_bytes("fsdp2", tmp_path, toy_source)
    assert ddp[0] == ddp[1]  # replicated
    for rank_bytes in fsdp2:
        assert rank_bytes <= 0.55 * ddp[0], f"fsdp2 rank holds {rank_bytes} bytes, ddp {ddp[0]}"
    # `plan` estimates the same from the parameter count (AdamW's per-tensor step counters aside).
    parameters = sum(p.numel() for p in Mlp(MlpConfig()).parameters())  # tests/toy-debug.yaml's model, 32-true
    for measured, stage in ((ddp, 0), (fsdp2, 3)):  # ddp replicates (stage 0); fully_shard shards all (stage 3)
        estimate = torch_model_states(parameters, "32-true", stage, data_parallel=2).total
        assert max(measured) == pytest.approx(estimate, rel=1e-3), stage
    print(f"training state per rank: ddp {ddp[0]} B, fsdp2 {fsdp2} B, ratio {max(fsdp2) / ddp[0]:.3f}")
