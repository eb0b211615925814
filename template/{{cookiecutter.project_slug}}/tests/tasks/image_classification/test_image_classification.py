"""The ViT under every strategy that runs on CPU, as real multi-process runs (gloo, 2 blocks, width 32, the digits).

Same seed, same global batch of 8 images: ddp, FSDP2, HSDP, 2-way tensor parallel (which splits the 2 heads),
FSDP2 with every block checkpointed and compiled, and DeepSpeed ZeRO-3 are the same computation, augmentation
included. A killed run resumes bitwise, a
folder `prepare` made from PNG files trains and resumes, checkpoints export to transformers'
ViTForImageClassification with the same logits, `predict` names the classes, and the cpu-debug recipe
learns the digits (validation accuracy well above 90%).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    PROJECT,
    RECIPES,
    assert_same_losses,
    final_weights,
    losses_by_run,
    read_csv_metrics,
    run_cli,
    train_args,
    train_each_layout_once,
    train_losses,
)

from {{ cookiecutter.package_name }}.checkpoint.tensors import load_model
from {{ cookiecutter.package_name }}.cli import main

pytestmark = pytest.mark.slow

STEPS = 4
# Random 1-pixel crops and flips on: every layout draws the same for a sample at the same place in the stream.
SHARED = [
    "--train.max_steps", str(STEPS), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
    "--checkpoint.resume", "auto", "--data.crop_padding", "1", "--data.flip", "true",
]  # fmt: skip
# name -> (overrides, nodes); every layout has a global batch of 8 images.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (["--strategy.name", "ddp"], 1),  # 2 processes x 4
    "fsdp2": ([], 1),  # 2 processes x 4
    "tp": (["--strategy.fsdp2.tensor_parallel_size", "2", "--train.micro_batch_size", "8"], 1),  # 1 x 8
    "hsdp": (["--strategy.name", "hsdp", "--num_nodes", "2", "--train.micro_batch_size", "2"], 2),  # 2 nodes x 2 x 2
    # every block recomputed in backward and compiled, as the decoder's are
    "fsdp2_checkpointing_compile": (
        ["--strategy.activation_checkpointing", "true", "--strategy.compile", "true"],
        1,
    ),
}
ZERO3 = ["--strategy.name", "deepspeed", "--strategy.deepspeed.stage", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> out_dir of that layout's run; each layout trains once per test session."""
    return train_each_layout_once(tmp_path_factory, LAYOUTS, SHARED)


def test_ddp_fsdp2_hsdp_tensor_parallel_and_compiled_blocks_train_the_vit_to_the_same_losses(
    trained: Callable[[str], Path],
) -> None:
    reference = train_losses(trained("ddp"))
    assert sorted(reference) == list(range(1, STEPS + 1))  # that it learns: the cpu-debug test at the end
    for name in ("fsdp2", "hsdp", "tp", "fsdp2_checkpointing_compile"):
        assert_same_losses(train_losses(trained(name)), reference, tolerance=1e-4)


def test_deepspeed_zero3_trains_the_vit_like_ddp(trained: Callable[[str], Path], tmp_path: Path) -> None:
    result = run_cli(*train_args(tmp_path, *SHARED, *ZERO3), script=PROJECT / "tests" / "deepspeed_on_cpu.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(train_losses(tmp_path), train_losses(trained("ddp")), tolerance=1e-5)


def assert_resumes_bitwise(reference: Path, out_dir: Path, *overrides: str) -> None:
    """Kill a run after its step-2 checkpoint, resume it, and compare losses and weights with `reference`'s."""
    killed = run_cli(*train_args(out_dir, *SHARED, *overrides), fault="kill-at-step:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*train_args(out_dir, *SHARED, *overrides))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    expected = train_losses(reference)
    before, after = losses_by_run(out_dir)
    assert before == {step: expected[step] for step in (1, 2, 3)}  # floats compared exactly
    assert after == {step: expected[step] for step in (3, 4)}
    weights, expected_weights = final_weights(out_dir, STEPS), final_weights(reference, STEPS)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)


def test_a_killed_vit_run_resumes_bitwise(trained: Callable[[str], Path], tmp_path: Path) -> None:
    assert_resumes_bitwise(trained("fsdp2"), tmp_path)  # the crops of the resumed steps are drawn again, the same


def image_folder(root: Path) -> Path:
    """A class-per-subfolder folder of PNG files: 3 classes of 12x12 RGB images told apart by colour, with noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, colour in enumerate([(220, 40, 40), (40, 200, 40), (40, 40, 230)]):
        (root / f"class-{label}").mkdir(parents=True)
        for index in range(16):
            pixels = np.clip(np.array(colour) + rng.normal(0, 30, (12, 12, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class-{label}" / f"{index}.png")
    return root


def test_a_prepared_png_folder_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images")
    prepared = tmp_path / "prepared"
    made = run_cli("prepare", str(folder), "--out", str(prepared), "--image_size", "8", "--channels", "3",
                   "--val_fraction", "0.25", "--workers", "2")  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    assert "48 images of 3 classes" in made.stdout
    data = [
        "--data.source",
        "prepared",
        "--data.path",
        str(prepared),
        "--model.channels",
        "3",
        "--model.num_classes",
        "3",
    ]
    reference = tmp_path / "uninterrupted"
    result = run_cli(*train_args(reference, *SHARED, *data, "--eval.every_steps", "4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(row.get("val/accuracy") for row in read_csv_metrics(reference))
    assert_resumes_bitwise(reference, tmp_path / "killed", *data, "--eval.every_steps", "4")


@pytest.mark.parametrize(("name", "split"), [("ddp", False), ("fsdp2", True)])
def test_an_exported_checkpoint_gives_transformers_the_same_logits(
    trained: Callable[[str], Path], tmp_path: Path, name: str, split: bool
) -> None:
    transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)
    checkpoint = trained(name) / "checkpoints" / f"step-{STEPS:08d}"
    shard_limit = "10000" if split else "1000000000"  # the ~0.1 MB of weights in several files, or one
    main(["export", str(checkpoint), str(tmp_path / "hf"), "--max_shard_bytes", shard_limit])
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == split
    exported = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert exported.config.id2label[3] == "3"
    model, _ = load_model(checkpoint)
    images = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(exported(images).logits, model(images), atol=1e-5, rtol=0)


def test_the_cpu_debug_recipe_learns_the_digits_and_predict_names_them(tmp_path: Path) -> None:
    """The shipped recipe as a user runs it (2 processes, FSDP2, 300 steps): validation accuracy above 90%."""
    result = run_cli("train", "--config", str(RECIPES / "cpu-debug.yaml"), "--out_dir", str(tmp_path / "run"),
                     "--logger.name", "csv", timeout=1200)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = [float(row["val/accuracy"]) for row in read_csv_metrics(tmp_path / "run") if row.get("val/accuracy")]
    assert accuracy[-1] > 0.9, accuracy

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    chosen = range(100, 110)
    files = [tmp_path / f"digit-{index}.png" for index in chosen]
    for index, file in zip(chosen, files, strict=True):  # as PNG files, the way a user would have them
        Image.fromarray(np.round(digits.images[index] * 255 / 16).astype(np.uint8)).save(file)
    predicted = run_cli("predict", str(tmp_path / "run"), *map(str, files), "--top", "2")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    lines = predicted.stdout.strip().splitlines()[-len(files) :]
    top = [line.split(": ")[1].split()[0] for line in lines]
    right = sum(label == str(digits.target[index]) for label, index in zip(top, chosen, strict=True))
    assert right >= 8, predicted.stdout
    missing = run_cli("predict", str(tmp_path / "run"), str(tmp_path / "missing.png"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: image {tmp_path / 'missing.png'} does not exist"
    ]
