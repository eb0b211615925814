"""The GPT's own parts of the strategies: its tensor-parallel plan, its init under meta-device builds, and a sharded
checkpoint of it exported to transformers.

The machinery's parity across every layout is tests/e2e/test_strategies.py, on the toy task; this file trains
the language model's GPT (cpu-debug with the tests' TINY sizes) where its own code is what is being checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_same_losses, train_each_layout_once, train_losses

from {{ cookiecutter.package_name }}.checkpoint.tensors import load_model
from {{ cookiecutter.package_name }}.cli import main

pytestmark = pytest.mark.slow

STEPS = 4
# name -> (overrides of cpu-debug + TINY, nodes): every layout has a global batch of 8 sequences.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (["--strategy.name", "ddp"], 1),  # 2 processes x 4
    "fsdp2": ([], 1),  # cpu-debug as it is: 2 processes x 4
    "tp": (["--strategy.fsdp2.tensor_parallel_size", "2", "--train.micro_batch_size", "8"], 1),  # 1 x 8
    "fsdp2_tp": (["--devices", "4", "--strategy.fsdp2.tensor_parallel_size", "2"], 1),  # 2 (x 2 tensor parallel) x 4
    "fsdp2_meta_init": (["--strategy.meta_init", "true"], 1),
}
SHARED = [
    "--train.max_steps", str(STEPS), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
    "--checkpoint.resume", "null",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> out_dir of that layout's run; each layout trains once per test session."""
    return train_each_layout_once(tmp_path_factory, LAYOUTS, SHARED)


def test_the_gpts_tensor_parallel_plan_gives_ddps_losses(trained: Callable[[str], Path]) -> None:
    reference = train_losses(trained("ddp"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    for name in ("tp", "fsdp2_tp"):
        assert_same_losses(train_losses(trained(name)), reference, tolerance=1e-4)


def test_a_meta_device_gpt_is_materialised_with_its_own_init_and_learns(trained: Callable[[str], Path]) -> None:
    losses = train_losses(trained("fsdp2_meta_init"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    # GPT-2 init gives near-uniform predictions over 256 byte values; garbage memory would not.
    assert abs(losses[1] - math.log(256)) < 0.1
    assert losses[STEPS] < losses[1]


def test_the_demo_recipes_sharded_checkpoint_exports_to_transformers_with_the_same_logits(
    trained: Callable[[str], Path], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)

    run_dir = trained("fsdp2")
    newest = run_dir / "checkpoints" / f"step-{STEPS:08d}"  # cpu-debug as it is (fsdp2, GPT-2's layout), tests' sizes
    main(["export", str(run_dir), str(tmp_path / "hf")])  # a run: its newest checkpoint
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_model(newest)
    tokens = torch.randint(0, 256, (2, model.config.block_size))
    with torch.no_grad():
        torch.testing.assert_close(reference(tokens).logits, model(tokens), atol=1e-5, rtol=0)
