"""The data order is a pure function of (seed, samples seen): resumable and independent of the process count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.data.sampler import TrainBatches, validation_batches
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.base import batch_loss
from {{ cookiecutter.package_name }}.tasks.language_model.config import DataConfig, LanguageModelRecipe, ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.data import load_tokens, make_demo_text, split_tokens
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import ShardedTokens
from {{ cookiecutter.package_name }}.tasks.language_model.data.windows import TokenWindows, document_ids
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.tasks.language_model.task import LanguageModel

TOKENS = np.arange(10_000, dtype=np.int64) % 251


def stream(
    dp_rank: int = 0, dp_size: int = 1, accum: int = 1, micro: int = 4, tokens: np.ndarray = TOKENS
) -> TrainBatches:
    return TrainBatches(
        TokenWindows(tokens, block_size=16),
        micro_batch_size=micro,
        grad_accum_steps=accum,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=7,
    )


def step_inputs(batches: TrainBatches) -> list[torch.Tensor]:
    return [inputs for inputs, _ in batches.next_step()]


def test_targets_are_inputs_shifted_by_one() -> None:
    inputs, targets = stream().next_step()[0]
    assert inputs.shape == (4, 16) and targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_resumed_stream_continues_the_same_sequence_across_epochs() -> None:
    full = stream()
    sequence = [step_inputs(full) for _ in range(400)]  # 624 windows, 4 per step: crosses two epoch boundaries
    assert full.epoch >= 2
    resumed = stream()
    for _ in range(150):
        resumed.next_step()
    saved = resumed.state_dict()
    fresh = stream()
    fresh.load_state_dict(saved)
    for expected in sequence[150:]:
        assert all(torch.equal(a, b) for a, b in zip(step_inputs(fresh), expected, strict=False))


def test_each_epoch_visits_every_window_once_in_a_new_order() -> None:
    batches = stream(micro=1)
    first = [int(step_inputs(batches)[0][0, 0]) for _ in range(batches.num_samples)]
    second = [int(step_inputs(batches)[0][0, 0]) for _ in range(batches.num_samples)]
    assert sorted(first) == sorted(second) == sorted(int(TOKENS[i * 16]) for i in range(batches.num_samples))
    assert first != second


def test_two_ranks_together_see_what_one_process_with_accumulation_sees() -> None:
    one = stream(dp_size=1, accum=2)
    rank0, rank1 = stream(dp_rank=0, dp_size=2), stream(dp_rank=1, dp_size=2)
    for _ in range(5):
        single = torch.cat(step_inputs(one))
        both = torch.cat(step_inputs(rank0) + step_inputs(rank1))
        assert torch.equal(single, both)
    assert not torch.equal(
        stream(dp_rank=0, dp_size=2).next_step()[0][0], stream(dp_rank=1, dp_size=2).next_step()[0][0]
    )


def test_checkpoint_from_other_data_is_refused() -> None:
    saved = stream().state_dict()
    with pytest.raises(RecipeError, match="training samples"):
        stream(tokens=TOKENS[:5000]).load_state_dict(saved)


def test_embedded_text_is_deterministic_and_byte_level() -> None:
    assert make_demo_text() == make_demo_text()
    tokens = load_tokens(DataConfig())
    assert tokens.dtype == np.uint8 and len(tokens) > 100_000


def test_text_folder_source_reads_all_txt_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("world")
    tokens = load_tokens(DataConfig(source="text", path=str(tmp_path)))
    assert bytes(tokens) == b"hello \n\nworld"


def test_token_file_is_memory_mapped(tmp_path: Path) -> None:
    ids = (np.arange(3000) * 7 % 50000).astype(np.uint16)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    tokens = load_tokens(DataConfig(source="tokens", path=str(path), token_dtype="uint16"))
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)
    train, val = split_tokens(tokens, 0.1, block_size=64)
    assert len(val) == 300 and len(train) == 2700


def test_missing_data_paths_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"data\.path"):
        load_tokens(DataConfig(source="tokens", path=str(tmp_path / "none.bin")))
    with pytest.raises(RecipeError, match=r"data\.path"):
        load_tokens(DataConfig(source="text", path=str(tmp_path)))


def test_validation_batches_are_disjoint_between_ranks() -> None:
    first = validation_batches(TokenWindows(TOKENS, 16), 4, 3, dp_rank=0, dp_size=2)
    second = validation_batches(TokenWindows(TOKENS, 16), 4, 3, dp_rank=1, dp_size=2)
    starts = {int(x[i, 0]) + 1000 * b for b, (x, _) in enumerate(first) for i in range(4)}
    assert len(first) == 3 and not any(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=False))
    assert len(starts) == 12


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "sub/x.bin"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path: Path, name: str) -> None:
    from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import verify

    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "outside.bin").write_bytes(b"\0" * 8)
    shards = [{"file": name, "tokens": 4, "sha256": "1" * 64}]
    manifest = {"dtype": "uint16", "tokenizer": {"sha256": "0" * 64}, "shards": shards}
    with pytest.raises(RecipeError, match="not a file in the folder"):
        verify(tmp_path, manifest, checksums=False)


# The shard-block shuffle: 10 shards of 400 tokens (the last 401) seen as one array, windows of 16 tokens (25 a
# shard, a block); token t is t.
DISTINCT = np.arange(4001, dtype=np.int64)
PIECES = [DISTINCT[i : i + 400] for i in range(0, 3600, 400)] + [DISTINCT[3600:]]
SHARDED = ShardedTokens(PIECES)


def block_stream(dp_rank: int = 0, dp_size: int = 1, tokens: ShardedTokens = SHARDED) -> TrainBatches:
    return TrainBatches(
        TokenWindows(tokens, block_size=16, blocks_per_group=2),
        micro_batch_size=2,
        grad_accum_steps=1,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=7,
    )


def test_block_shuffle_is_a_permutation_per_epoch_whose_groups_read_few_shards() -> None:
    batches = block_stream()
    windows = batches.num_samples
    assert windows == 250 and batches.shuffle is not None
    order = [batches._sample_of(g) for g in range(2 * windows)]
    first, second = order[:windows], order[windows:]
    assert sorted(first) == list(range(windows)) and sorted(second) == list(range(windows))
    assert first != second and first != sorted(first)
    for epoch in (first, second):  # 2 blocks of 25 windows a group: each group's windows start in 2 shards only
        groups = [epoch[start : start + 50] for start in range(0, windows, 50)]
        assert all(len({window * 16 // 400 for window in group}) <= 2 for group in groups)
        assert any(group != sorted(group) for group in groups)  # windows shuffled inside a group
    assert len({window * 16 // 400 for window in first[: windows // 2]}) > 3  # the epoch still goes everywhere


def test_block_shuffle_is_the_same_for_any_process_count_and_resumes_exactly() -> None:
    whole = [block_stream()._sample_of(g) for g in range(600)]  # 600 windows: past an epoch boundary
    for dp_size in (1, 2):
        ranks = [block_stream(rank, dp_size) for rank in range(dp_size)]
        seen: list[int] = []
        for _ in range(600 // (2 * dp_size)):
            seen += [int(row[0]) // 16 for rank in ranks for row in rank.next_step()[0][0]]
        assert seen == whole
    uninterrupted = block_stream()
    sequence = [uninterrupted.next_step()[0][0] for _ in range(300)]
    resumed = block_stream()
    for _ in range(110):
        resumed.next_step()
    fresh = block_stream()
    fresh.load_state_dict(resumed.state_dict())
    assert all(torch.equal(fresh.next_step()[0][0], expected) for expected in sequence[110:])
    other_groups = TrainBatches(TokenWindows(SHARDED, 16, blocks_per_group=3), 2, 1, dp_rank=0, dp_size=1, seed=7)
    with pytest.raises(RecipeError, match="made with 2 blocks of samples shuffled together, this recipe's data"):
        other_groups.load_state_dict(resumed.state_dict())


def test_block_shuffle_tells_the_samples_which_shards_come_next() -> None:
    told: list[list[int]] = []

    class Watched(list):
        def will_read(self, shards: list[int]) -> None:
            told.append(shards)

    batches = block_stream(tokens=ShardedTokens(Watched(PIECES)))
    for _ in range(200):
        inputs = batches.next_step()[0][0]
        shards = {min(int(token) // 400, 9) for row in inputs for token in (row[0], row[-1] + 1)}
        assert shards <= set(told[-1])  # told before the step read them
    # Told once a group (~25 steps), each time this group's shards and the next group's: at most 2 x 2 x 2.
    assert 5 < len(told) < 20 and all(len(shards) <= 8 for shards in told)


# --- data.document_mask: a stream's documents attend only to themselves -------------------------------------


def test_an_end_of_document_token_belongs_to_the_document_it_ends() -> None:
    inputs = np.array([[5, 10, 7, 10, 10, 3], [10, 1, 2, 3, 4, 5]])
    assert document_ids(inputs, end=10).tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_under_document_mask_each_sentence_of_the_demo_text_is_predicted_as_if_it_were_alone(arch: str) -> None:
    """The embedded corpus's documents are its lines. A window's batch carries their ids, the task hands them to the
    model, and a sentence's logits in the window are its logits alone in a row (its positions start at 0);
    without the mask they are not."""
    torch.manual_seed(0)
    model_config = ModelConfig(arch=arch, vocab_size=256, block_size=96, n_layer=2, n_head=2, n_embd=32)
    task = LanguageModel(LanguageModelRecipe(model=model_config, data=DataConfig(document_mask=True)))
    task.check()
    batch = task.datasets().train.batch([3])
    inputs, documents = task.split_batch(batch)[0]
    tokens = inputs[0].tolist()
    ends = [i for i, token in enumerate(tokens) if token == ord("\n")]
    assert len(ends) >= 2 and torch.equal(documents[0], torch.as_tensor(document_ids(inputs.numpy(), ord("\n"))[0]))
    start, stop = ends[0] + 1, ends[1] + 1  # the first whole sentence, with its newline
    model = build_model(model_config).eval()
    with torch.no_grad():
        in_window = model(inputs, documents=documents)[0, start:stop]
        alone = model(inputs[:, start:stop])[0]
        plain = model(inputs)[0, start:stop]
        masked_loss = batch_loss(task, model, batch).task_loss
        plain_loss = batch_loss(LanguageModel(LanguageModelRecipe(model=model_config)), model, batch[:2]).task_loss
    torch.testing.assert_close(in_window, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, alone, atol=1e-3)  # plain causal attention sees the sentences before it
    assert not torch.isclose(masked_loss, plain_loss)
