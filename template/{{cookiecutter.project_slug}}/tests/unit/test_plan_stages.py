"""plan sizes each pipeline rank on its own (planner/pipeline.py): the blocks its stages hold as the pipeline splits
them, the embedding or the head, the pieces its schedule keeps in flight, the loss on the last stage's rank only.
Hand-computed on a model of round sizes; the figures they stand for were rehearsed (docs/strategies.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from {{ cookiecutter.package_name }}.planner.pipeline import pipeline_terms, rank_loads, rank_pieces
from {{ cookiecutter.package_name }}.tasks.base import Activations

BLOCK = 1000  # parameters of one block
END = 1500  # the embedding, and the head: a block and a half each


@dataclass(frozen=True)
class RoundModel:
    """The size formulas `plan` asks of a task (tasks/base.py's ModelCost), in round numbers: 12 blocks of 1000
    parameters between an embedding and a head of 1500, split by tensor parallel alike; per sample a block holds 10
    bytes (1 checkpointed) and the loss 100 beside them, its gradients 50 more."""

    n_layer: int = 12

    def parameters(self, tensor_parallel: int = 1) -> int:
        return (self.n_layer * BLOCK + 2 * END) // tensor_parallel

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        return BLOCK // tensor_parallel

    def pipeline_end_parameters(self, tensor_parallel: int = 1) -> tuple[int, int]:
        return END // tensor_parallel, END // tensor_parallel

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        layers = self.n_layer * micro_batch
        return Activations(
            paper=10.0 * layers,
            paper_checkpointed=1.0 * layers,
            held=10.0 * layers + 100 * micro_batch,
            held_checkpointed=1.0 * layers + 100 * micro_batch,
            recompute_peak=10.0 * micro_batch,
            backward_transient=50.0 * micro_batch,
        )

    def hidden_elements(self, micro_batch: int) -> float:
        return 7.0 * micro_batch


MODEL = RoundModel()


def test_the_embedding_and_the_head_take_blocks_off_their_stages() -> None:
    """Four stages of 12 blocks: the ends weigh 1.5 blocks, so the first and last stages get 2 blocks, the middle
    ones 4 (stage parameters 3500, 4000, 4000, 3500); under 1F1B rank r holds stage r."""
    loads = rank_loads(MODEL, 4, "1F1B", 1, pieces=8)
    assert [load.blocks for load in loads] == [2, 4, 4, 2]
    assert [load.ends for load in loads] == [END, 0, 0, END]
    assert [load.block_pieces for load in loads] == [4 * 2, 3 * 4, 2 * 4, 1 * 2]  # min(m, p - r) pieces
    assert [load.loss_pieces for load in loads] == [0, 0, 0, 1]


def test_zero_bubble_v_puts_both_ends_on_the_first_rank() -> None:
    """ZB-V over 2 ranks: 4 stages split 2, 4, 4, 2; rank 0 holds stages 0 and 3 (both ends, 4 blocks), rank 1 the
    middle two (8 blocks); every piece of the micro-batch is held, the loss's too (module docstring)."""
    first, second = rank_loads(MODEL, 2, "ZBVZeroBubble", 2, pieces=8, tensor_parallel=2)
    assert (first.blocks, first.ends, first.block_pieces, first.loss_pieces) == (4, 2 * END // 2, 8 * 4, 8)
    assert (second.blocks, second.ends, second.block_pieces, second.loss_pieces) == (8, 0, 8 * 8, 0)


@pytest.mark.parametrize(
    ("schedule", "per_rank", "expected"),
    [
        ("GPipe", 1, [8, 8, 8, 8]),
        ("1F1B", 1, [4, 3, 2, 1]),
        ("Interleaved1F1B", 2, [5.5] * 4),  # min(m, p) (1 + (p - 1) / (p v)): the first rank's, for each
        ("InterleavedZeroBubble", 2, [8] * 4),
        ("ZBVZeroBubble", 2, [8] * 4),
    ],
)
def test_each_schedule_holds_its_pieces_on_each_rank(schedule: str, per_rank: int, expected: list[float]) -> None:
    assert [rank_pieces(schedule, 4, 8, per_rank, rank) for rank in range(4)] == expected


def test_a_rank_holds_its_blocks_activations_and_only_the_last_holds_the_loss() -> None:
    """1F1B over 4 ranks, micro batch 8 in pieces of one sample: rank 0 holds 4 pieces through 2 blocks, rank 3 one
    piece through 2 blocks and its loss; checkpointed, a block keeps 1 byte a sample of its 10."""
    first = pipeline_terms(MODEL, 4, "1F1B", 1, micro_batch=8, pieces=8, precision="bf16-mixed", rank=0)
    last = pipeline_terms(MODEL, 4, "1F1B", 1, micro_batch=8, pieces=8, precision="bf16-mixed", rank=3)
    assert (first.rank, first.layers, first.ends, last.rank, last.ends) == (0, 2, END, 3, END)
    assert (first.activations.held, first.activations.held_checkpointed) == (4 * 2 * 10, 4 * 2 * 1)
    assert (first.activations.recompute_peak, first.activations.backward_transient) == (10, 0)
    assert (last.activations.held, last.activations.held_checkpointed) == (2 * 10 + 100, 2 * 1 + 100)
    assert last.activations.checkpointed_peak == 2 * 1 + 100 + 50  # the loss's gradients, not one block rebuilt
    assert len(first.loads) == 4 and first.loads == last.loads


def test_checkpointing_saves_nothing_under_a_zero_bubble_schedule() -> None:
    """The input half keeps the graph for the weight half, recomputed activations included: plan counts a
    zero-bubble rank's blocks uncheckpointed either way (rehearsed: 37.9 GiB checkpointed, 33.6 GiB not)."""
    terms = pipeline_terms(MODEL, 2, "ZBVZeroBubble", 2, micro_batch=8, pieces=8, precision="bf16-mixed", rank=1)
    assert terms.activations.held == terms.activations.held_checkpointed == 8 * 8 * 10
