"""The Llama family under every strategy that runs on CPU, as real multi-process runs (gloo, 2 layers, width 64).

Same seed, same global batch of 8 sequences: ddp, FSDP2, HSDP, 2-way tensor parallel (which splits the
4 query and 2 key/value heads) and DeepSpeed ZeRO-3 are the same computation. A killed run resumes
bitwise, its checkpoints export to transformers with the same logits, and init_from loads the same
weights on 1 process and on 2 (FSDP2 built on the meta device, tensor parallel, ZeRO-3).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    PROJECT,
    assert_same_losses,
    final_weights,
    losses_by_run,
    run_cli,
    train_args,
    train_each_layout_once,
    train_losses,
)

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.tasks.language_model.sample import load_model

transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)

pytestmark = pytest.mark.slow

STEPS = 4
# 4 query heads sharing 2 key/value heads: tensor parallel over 2 keeps 2 query heads and 1 key/value head per rank
# (cpu-debug's GPT has biases, a GPT-only field: back to its default for the Llama).
LLAMA = ["--model.arch", "llama", "--model.bias", "false", "--model.n_head", "4", "--model.n_kv_head", "2"]
LLAMA += ["--model.intermediate_size", "96"]
SHARED = [
    *LLAMA, "--train.max_steps", str(STEPS), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
    "--checkpoint.resume", "auto",
]  # fmt: skip
# name -> (overrides, nodes); every layout has a global batch of 8 sequences.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (["--strategy.name", "ddp"], 1),  # 2 processes x 4
    "fsdp2": ([], 1),  # 2 processes x 4
    "tp": (["--strategy.fsdp2.tensor_parallel_size", "2", "--train.micro_batch_size", "8"], 1),  # 1 x 8
    "hsdp": (["--strategy.name", "hsdp", "--num_nodes", "2", "--train.micro_batch_size", "2"], 2),  # 2 nodes x 2 x 2
}
ZERO3 = ["--strategy.name", "deepspeed", "--strategy.deepspeed.stage", "3"]
PIPELINE = [
    "--strategy.fsdp2.pipeline_parallel_size", "2", "--strategy.fsdp2.pipeline_microbatches", "4",
    "--train.micro_batch_size", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> out_dir of that layout's run; each layout trains once per test session."""
    return train_each_layout_once(tmp_path_factory, LAYOUTS, SHARED)


def test_ddp_fsdp2_and_tensor_parallel_train_the_llama_to_the_same_losses(trained: Callable[[str], Path]) -> None:
    reference = train_losses(trained("ddp"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1]
    for name in ("fsdp2", "tp"):  # tp: the Llama's own tensor-parallel plan
        assert_same_losses(train_losses(trained(name)), reference, tolerance=1e-4)


@pytest.mark.matrix  # hsdp's machinery is the model's own in tests/e2e/test_strategies.py
def test_hsdp_trains_the_llama_to_the_losses_of_ddp(trained: Callable[[str], Path]) -> None:
    assert_same_losses(train_losses(trained("hsdp")), train_losses(trained("ddp")), tolerance=1e-4)


def test_deepspeed_zero3_trains_the_llama_like_ddp(trained: Callable[[str], Path], tmp_path: Path) -> None:
    script = PROJECT / "tests" / "deepspeed_on_cpu.py"
    result = run_cli(*train_args(tmp_path, *SHARED, *ZERO3), script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(train_losses(tmp_path)) == list(range(1, STEPS + 1))
    assert_same_losses(train_losses(tmp_path), train_losses(trained("ddp")), tolerance=1e-5)


def test_a_killed_llama_run_resumes_bitwise(trained: Callable[[str], Path], tmp_path: Path) -> None:
    reference = trained("fsdp2")
    killed = run_cli(*train_args(tmp_path, *SHARED), fault="kill-at-step:3")  # after the save of step 2
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*train_args(tmp_path, *SHARED))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    expected = train_losses(reference)
    before, after = losses_by_run(tmp_path)
    assert before == {step: expected[step] for step in (1, 2, 3)}  # floats compared exactly
    assert after == {step: expected[step] for step in (3, 4)}
    weights, expected_weights = final_weights(tmp_path, STEPS), final_weights(reference, STEPS)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)


@pytest.mark.parametrize(("name", "split"), [("ddp", False), ("fsdp2", True)])
def test_an_exported_checkpoint_gives_transformers_the_same_logits(
    trained: Callable[[str], Path], tmp_path: Path, name: str, split: bool
) -> None:
    checkpoint = trained(name) / "checkpoints" / f"step-{STEPS:08d}"
    shard_limit = "100000" if split else "1000000000"  # the ~0.4 MB of weights in several files, or one
    main(["export", str(checkpoint), str(tmp_path / "hf"), "--max_shard_bytes", shard_limit])
    files = list((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 if split else [file.name for file in files] == ["model.safetensors"]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == split
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_model(checkpoint)
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], float]:
    """(train overrides starting from a saved transformers Llama, the first loss of that start on one process)."""
    folder = tmp_path_factory.mktemp("pretrained") / "hf"
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a head far from a fresh init's: a run that ignored the weights would start near ln(256)
        model.lm_head.weight.normal_(std=1.0)
    model.save_pretrained(folder)
    start = [*SHARED, "--model.init_from", str(folder), "--train.max_steps", "1"]
    out_dir = tmp_path_factory.mktemp("pretrained-one-process")
    one = run_cli(*train_args(out_dir, *start, "--devices", "1", "--train.micro_batch_size", "8"))
    assert one.returncode == 0, one.stderr[-3000:]
    first = train_losses(out_dir)[1]
    assert abs(first - math.log(256)) > 1.0, first
    return start, first


def test_init_from_under_fsdp2_gives_the_same_first_step_loss_on_one_and_two_processes(
    pretrained: tuple[list[str], float], tmp_path: Path
) -> None:
    start, first = pretrained
    # Two processes, built on the meta device: each rank materialises its shards, then gets its part of the weights.
    two = run_cli(*train_args(tmp_path, *start, "--strategy.meta_init", "true"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "Started from the weights of" in two.stdout
    assert abs(train_losses(tmp_path)[1] - first) <= 1e-5


@pytest.mark.parametrize("layout", ["tp", "zero3", pytest.param("pp", marks=pytest.mark.matrix)])
def test_init_from_loads_the_same_weights_under_tensor_parallel_zero3_and_a_pipeline(
    pretrained: tuple[list[str], float], tmp_path: Path, layout: str
) -> None:
    start, first = pretrained
    if layout == "tp":  # each rank gets its heads' rows of q, k, v and columns of o
        result = run_cli(*train_args(tmp_path, *start, *LAYOUTS["tp"][0]))
    elif layout == "pp":  # each stage, built on the meta device, gets its own blocks (and embeddings or head)
        result = run_cli(*train_args(tmp_path, *start, *PIPELINE, "--strategy.meta_init", "true"))
    else:  # copied in before DeepSpeed takes its fp32 copies, one gathered parameter at a time
        result = run_cli(*train_args(tmp_path, *start, *ZERO3), script=PROJECT / "tests" / "deepspeed_on_cpu.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert abs(train_losses(tmp_path)[1] - first) <= 1e-5
