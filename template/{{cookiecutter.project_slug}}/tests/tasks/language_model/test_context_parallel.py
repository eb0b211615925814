"""Context parallel on the language model: the load-balanced split of a sequence, the positions and masks of each
rank's part (simulated in one process), refusals of sizes that cannot split, and cp=2 over 2 processes training as
one process does."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from helpers import (
    RECIPES,
    TINY,
    assert_same_losses,
    assert_same_weights,
    fail_with,
    final_weights,
    losses_by_run,
    read_csv_metrics,
    run_cli,
    run_nodes,
    train_losses,
)
from torch.utils._python_dispatch import TorchDispatchMode

from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.strategies.context_parallel import SequenceShard, chunk_positions, sharding
from {{ cookiecutter.package_name }}.tasks.language_model.families.context import split_attention
from {{ cookiecutter.package_name }}.tasks.language_model.families.documents import example_attention


def test_each_rank_holds_two_chunks_that_balance_the_causal_work() -> None:
    parts = [chunk_positions(16, rank, 2).tolist() for rank in range(2)]
    assert parts == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    parts = [chunk_positions(24, rank, 3) for rank in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(24))  # every position once
    assert len({int((part + 1).sum()) for part in parts}) == 1  # the keys each rank's queries see: equal


@dataclass(frozen=True)
class SimulatedShard(SequenceShard):
    """A rank of a group simulated in one process: `gather` returns every rank's part of the whole tensor it was
    split from (`wholes`, by dimension)."""

    wholes: tuple[torch.Tensor, ...] = ()

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        whole = next(w for w in self.wholes if w.dim() == x.dim() and w.dtype == x.dtype)
        length = whole.shape[dim]
        parts = [whole.index_select(dim, chunk_positions(length, r, self.size)) for r in range(self.size)]
        return torch.cat(parts, dim)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation makes while the mode is on."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return result


@pytest.mark.parametrize("packed", [False, True])
def test_attention_over_the_gathered_keys_gives_each_ranks_part_of_the_whole_sequences_output(packed: bool) -> None:
    torch.manual_seed(0)
    batch, heads, time, size = 2, 2, 16, 2
    q, k, v = (torch.randn(batch, heads, time, 8) for _ in range(3))
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    if documents is None:
        whole, whole_positions = F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.arange(time)
    else:
        mask, whole_positions = example_attention(documents)
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for rank in range(size):
        wholes = (k,) if documents is None else (k, documents)
        shard = SimulatedShard(None, rank, size, wholes=wholes)
        own = chunk_positions(time, rank, size)
        part_documents = None if documents is None else shard.split(documents)
        with sharding(shard), LargestTensor() as made:
            layout = split_attention(time // size, part_documents, q.device)
        assert layout is not None
        assert made.numel <= batch * (time // size) * time  # its rows of the mask, never the whole (time x time)
        mask, positions = layout
        keys, values = shard.gather(k, 2), SimulatedShard(None, rank, size, wholes=(v,)).gather(v, 2)
        part = F.scaled_dot_product_attention(shard.split(q, 2), keys, values, attn_mask=mask)
        torch.testing.assert_close(part, whole[:, :, own], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(positions, whole_positions[..., own])


def test_without_a_shard_the_model_sees_whole_sequences() -> None:
    assert split_attention(8, None, torch.device("cpu")) is None


CP_RECIPE = RECIPES / "cpu-cp-debug.yaml"


def test_mfu_under_context_parallel_counts_attention_at_the_full_sequence_length() -> None:
    """A rank's queries (block_size / cp of every sequence) attend over the keys of the whole sequence: its FLOPs per
    own token are those of a token of the unsplit sequence, and the monitor gives each rank its share of the tokens
    (the data-parallel ranks' samples, each sequence counted once, over every rank)."""
    recipe = load_recipe(CP_RECIPE)
    strategy, model = strategy_for(recipe), recipe.model
    size, length = recipe.strategy.fsdp2.context_parallel_size, model.block_size
    flops = strategy.task.flops_per_unit()
    part = parse_recipe(["--config", str(CP_RECIPE), "--model.block_size", str(length // size)])
    flops_of_the_part = strategy_for(part).task.flops_per_unit()  # attention over a rank's own positions only
    assert flops - flops_of_the_part == 12 * model.n_layer * model.n_embd * (length - length // size)
    assert strategy.data_parallel_size() * length / recipe.world_size == length // size  # each rank's tokens


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--strategy.fsdp2.context_parallel_size", "3"], "context_parallel_size=3 does not divide the 2 data"),
        (["--model.block_size", "66"], "sequence length 66 does not divide into 2 x 2 equal chunks (choose 1)"),
        (
            ["--strategy.fsdp2.pipeline_parallel_size", "2"],
            "context_parallel_size=2 does not divide the 1 data-parallel ranks (devices x num_nodes /"
            " tensor_parallel_size x pipeline_parallel_size): choose 1",
        ),
        (
            ["--strategy.name", "hsdp", "--num_nodes", "2", "--strategy.fsdp2.context_parallel_size", "4"],
            "context_parallel_size=4: under strategy.name=hsdp a context-parallel group (with its tensor-parallel ranks,"
            " 4) lies inside a node: choose a size that divides devices=2 / tensor_parallel_size=1",
        ),
        (["--strategy.fsdp2.context_parallel_size", "0"], "context_parallel_size"),
    ],
)
def test_context_parallel_sizes_that_cannot_split_are_refused_in_one_line(
    overrides: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--config", str(CP_RECIPE), "--out_dir", str(tmp_path / "run"), *overrides]
    assert message in fail_with(argv, capsys)


def trains_as_whole_sequences(
    tmp_path: Path, shared: list[str], split: list[str], validations: int, steps: int = 4
) -> None:
    """`shared` (a `train` command line of `steps` steps) run split (`split`: its overrides, one data-parallel rank)
    in `split/` and on 1 process on whole sequences in `whole/`, the same samples: the same losses and gradient norms
    (1e-5), and the same `validations` validation losses."""
    whole = ["--devices", "1", "--strategy.fsdp2.context_parallel_size", "1"]
    runs = {"split": split, "whole": whole}
    for name, overrides in runs.items():
        result = run_cli(*shared, *overrides, "--out_dir", str(tmp_path / name))
        assert result.returncode == 0, result.stderr[-3000:]
    losses = {name: train_losses(tmp_path / name) for name in runs}
    assert sorted(losses["whole"]) == list(range(1, steps + 1))
    assert_same_losses(losses["split"], losses["whole"], tolerance=1e-5)
    norms = {
        name: [float(row["train/grad_norm"]) for row in read_csv_metrics(tmp_path / name) if row.get("train/grad_norm")]
        for name in runs
    }
    assert len(norms["whole"]) == steps
    assert norms["split"] == pytest.approx(norms["whole"], abs=1e-5)
    validation = {
        name: [float(row["val/loss"]) for row in read_csv_metrics(tmp_path / name) if row.get("val/loss")]
        for name in runs
    }
    assert len(validation["whole"]) == validations
    assert validation["split"] == pytest.approx(validation["whole"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "data",
    [
        pytest.param([], id="causal"),
        # Pretraining with document masking: the demo text's sentences attend only to themselves, across the parts.
        pytest.param(["--data.document_mask", "true"], id="document-mask"),
        # Packed chat examples: block-diagonal masks across the parts, replies counted unevenly by the two ranks.
        pytest.param(["--data.format", "sft", "--data.packing", "true"], id="packed-sft", marks=pytest.mark.matrix),
    ],
)
def test_context_parallel_over_2_processes_trains_as_one_process_on_whole_sequences(
    data: list[str], tmp_path: Path
) -> None:
    shared = [
        "train", "--config", str(CP_RECIPE), *TINY, "--model.n_kv_head", "1", "--train.micro_batch_size", "4",
        "--train.max_steps", "8", "--eval.every_steps", "8", "--checkpoint.save_every_steps", "0",
        "--checkpoint.resume", "null", "--logger.name", "csv", *data,
    ]  # fmt: skip
    # split: 2 processes, each half of every sequence of the same samples (one data-parallel rank, as the cp group
    # is one).
    trains_as_whole_sequences(tmp_path, shared, [], validations=1, steps=8)


def degree_args(out_dir: Path, degree: int, steps: int) -> list[str]:
    """cpu-cp-debug shrunk to seconds at context-parallel degree `degree`, on `degree` processes: one data-parallel
    rank either way, so every degree reads the same samples."""
    return [
        "train", "--config", str(CP_RECIPE), "--out_dir", str(out_dir), *TINY, "--model.n_kv_head", "1",
        "--devices", str(degree), "--strategy.fsdp2.context_parallel_size", str(degree), "--logger.name", "csv",
        "--train.max_steps", str(steps), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "3",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_killed_under_context_parallel_resumes_bitwise(tmp_path: Path) -> None:
    """cp=2 SIGKILLed after step 4 (the checkpoint of step 3 on disk) and resumed at the same degree: the steps it
    redoes and the rest are the uninterrupted run's, losses compared exactly, and so are its final weights."""
    reference = tmp_path / "reference"
    assert run_cli(*degree_args(reference, 2, 5)).returncode == 0
    (expected,) = losses_by_run(reference)
    killed = tmp_path / "killed"
    assert run_cli(*degree_args(killed, 2, 5), fault="kill-at-step:4").returncode == -signal.SIGKILL
    resumed = run_cli(*degree_args(killed, 2, 5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before_kill, after_resume = losses_by_run(killed)
    assert max(before_kill) == 4 and after_resume.keys() == {4, 5}
    assert before_kill == {step: expected[step] for step in before_kill}  # bitwise: floats compared exactly
    assert after_resume == {step: expected[step] for step in (4, 5)}
    assert_same_weights(final_weights(killed, 5), final_weights(reference, 5))


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_under_another_context_parallel_degree(before: int, after: int, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert run_cli(*degree_args(reference, after, 5)).returncode == 0
    (expected,) = losses_by_run(reference)
    moved = tmp_path / "moved"
    assert run_cli(*degree_args(moved, before, 5), fault="kill-at-step:4").returncode == -signal.SIGKILL
    resumed = run_cli(*degree_args(moved, after, 5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, after_resume = losses_by_run(moved)
    assert after_resume.keys() == {4, 5}
    assert all(abs(after_resume[step] - expected[step]) < 1e-4 for step in after_resume), (after_resume, expected)


@pytest.mark.slow
@pytest.mark.matrix
def test_context_parallel_x_fsdp2_over_4_processes_trains_as_fsdp2_alone_on_whole_sequences(tmp_path: Path) -> None:
    shared = [
        "--config", str(RECIPES / "cpu-cp-fsdp2-debug.yaml"), *TINY, "--model.n_kv_head", "1",
        "--train.max_steps", "4", "--eval.every_steps", "0", "--checkpoint.save_every_steps", "0",
        "--checkpoint.resume", "null", "--logger.name", "csv",
    ]  # fmt: skip
    # cp x dp: 4 processes, 2 data-parallel ranks each splitting its samples' sequences over 2; dp: the same 2
    # data-parallel ranks on whole sequences, 2 processes.
    whole = ["--devices", "2", "--strategy.fsdp2.context_parallel_size", "1"]
    runs = {"cp": ["--out_dir", str(tmp_path / "cp")], "dp": ["--out_dir", str(tmp_path / "dp"), *whole]}
    for overrides in runs.values():
        result = run_cli("train", *shared, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
    losses = {name: train_losses(tmp_path / name) for name in runs}
    assert sorted(losses["dp"]) == [1, 2, 3, 4]
    assert_same_losses(losses["cp"], losses["dp"], tolerance=1e-5)


@pytest.mark.slow
def test_context_parallel_under_hsdp_trains_as_hsdp_alone_on_whole_sequences(tmp_path: Path) -> None:
    """2 nodes: each node's 2 processes split the sequences of the node's samples (the group inside the node), the
    shards replicated across the nodes; against 2 nodes of 1 process on whole sequences (the same 2 data-parallel
    ranks, one a node, so the same samples)."""
    shared = [
        "train", "--config", str(CP_RECIPE), *TINY, "--model.n_kv_head", "1", "--train.max_steps", "4",
        "--eval.every_steps", "0", "--checkpoint.save_every_steps", "0", "--checkpoint.resume", "null",
        "--logger.name", "csv", "--strategy.name", "hsdp", "--num_nodes", "2",
    ]  # fmt: skip
    whole = ["--devices", "1", "--strategy.fsdp2.context_parallel_size", "1"]
    runs = {"cp": ["--out_dir", str(tmp_path / "cp")], "whole": ["--out_dir", str(tmp_path / "whole"), *whole]}
    for overrides in runs.values():
        run_nodes([*shared, *overrides], nodes=2)
    losses = {name: train_losses(tmp_path / name) for name in runs}
    assert sorted(losses["whole"]) == [1, 2, 3, 4]
    assert_same_losses(losses["cp"], losses["whole"], tolerance=1e-5)
    # The states sharded over a node's 2 ranks and all-reduced across the nodes, as plan says hsdp holds them.
    rehearsal = run_cli("rehearse", "cpu-cp-debug", "--strategy.name", "hsdp", "--num_nodes", "2", "--json")
    assert rehearsal.returncode == 0, rehearsal.stderr[-3000:]
    result = json.loads(rehearsal.stdout)
    plan, rank = result["plan"], result["ranks"][0]
    assert all(rank[held] == plan[held] for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"))
    assert rank["collectives"]["allreduce"] == plan["collectives"]["allreduce"] > 1  # more than the step decision's


@pytest.mark.slow
def test_context_parallel_x_tensor_parallel_over_4_processes_trains_as_one_process_on_whole_sequences(
    tmp_path: Path,
) -> None:
    """cp=2 x tp=2: each context-parallel rank's half of every sequence, its heads split over 2 tensor-parallel
    ranks, which gather the keys and values of their own heads from their context peers; one data-parallel rank
    either way, so the same samples."""
    shared = [
        "train", "--config", str(CP_RECIPE), *TINY, "--train.max_steps", "4", "--eval.every_steps", "0",
        "--checkpoint.save_every_steps", "0", "--checkpoint.resume", "null", "--logger.name", "csv",
    ]  # fmt: skip
    split = ["--devices", "4", "--strategy.fsdp2.tensor_parallel_size", "2"]
    trains_as_whole_sequences(tmp_path, shared, split, validations=0)


@pytest.mark.slow
def test_context_parallel_x_pipeline_over_4_processes_trains_as_one_process_on_whole_sequences(
    tmp_path: Path,
) -> None:
    """cp=2 x pp=2: each stage's 2 context-parallel ranks hold halves of every sequence, and the pipeline passes each
    half's activations to the next stage's rank with the same half; one data-parallel rank either way, so the same
    samples. Validation runs through the schedule on the halves too."""
    shared = [
        "train", "--config", str(CP_RECIPE), *TINY, "--model.n_kv_head", "1", "--train.max_steps", "4",
        "--eval.every_steps", "4", "--checkpoint.save_every_steps", "0", "--checkpoint.resume", "null",
        "--logger.name", "csv",
    ]  # fmt: skip
    split = ["--devices", "4", "--strategy.fsdp2.pipeline_parallel_size", "2",
             "--strategy.fsdp2.pipeline_microbatches", "2"]  # fmt: skip
    trains_as_whole_sequences(tmp_path, shared, split, validations=1)


@pytest.mark.slow
def test_a_rank_at_cp2_holds_what_half_the_sequence_holds_without_it_and_the_mask() -> None:
    """cpu-cp-debug (no checkpointing, fp32) rehearsed at 2048 tokens over cp=2 against 1024 tokens without context
    parallel: the attention recomputes itself in backward, so beyond its own half a rank holds only the boolean mask
    (1024 x 2048 bytes), not each layer's gathered keys and values nor SDPA's float mask (12 MiB a layer, 48 MiB in
    all); it gathers the keys and values twice a layer (forward, recomputation) and reduce-scatters them once."""

    def rehearsed(*overrides: str) -> dict:
        unchecked = ["--strategy.activation_checkpointing", "false"]
        result = run_cli("rehearse", "cpu-cp-debug", *unchecked, *overrides, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    split = rehearsed("--model.block_size", "2048")
    half = rehearsed("--model.block_size", "1024", "--strategy.fsdp2.context_parallel_size", "1")
    mask = 1024 * 2048
    for rank in split["ranks"]:
        assert half["ranks"][0]["peak_bytes"] <= rank["peak_bytes"] <= half["ranks"][0]["peak_bytes"] + mask
        layers, micro_batches = 4, 1
        gathers = rank["collectives"]["allgather"] - half["ranks"][0]["collectives"]["allgather"]
        assert gathers == 2 * 2 * layers * micro_batches  # keys and values, in forward and recomputed
        assert rank["collectives"]["reduce_scatter"] - half["ranks"][0]["collectives"]["reduce_scatter"] == 2 * layers
