"""`rehearse` on the library's GPU recipes at their own size: what each rank holds is what `plan` says, to the byte;
the step's peak is within 10% of plan's, and its collectives are the ones plan's communication model counts."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

PEAK_WITHIN = 0.10  # the rehearsed peak against plan's (docs/strategies.md: what neither counts)


def rehearsed(recipe: str, ranks: list[int]) -> dict:
    """The recipe's chosen ranks rehearsed, as JSON."""
    result = run_cli("rehearse", recipe, "--ranks", ",".join(map(str, ranks)), "--json")
    assert result.returncode == 0, result.stderr
    rehearsal = json.loads(result.stdout)
    assert [rank["rank"] for rank in rehearsal["ranks"]] == ranks
    return rehearsal


def assert_as_planned(rehearsal: dict) -> None:
    """Model states to the byte, the peak within PEAK_WITHIN, the collectives plan counts (where it counts them)."""
    plan = rehearsal["plan"]
    for rank in rehearsal["ranks"]:
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == plan[held], (rank["rank"], held)
        assert rank["peak_bytes"] == pytest.approx(plan["peak_bytes"], rel=PEAK_WITHIN), rank["rank"]
        counted = plan["collectives"] or {}
        assert {name: rank["collectives"].get(name, 0) for name in counted} == counted, rank["rank"]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "ranks"), [("fsdp2-node", [0, 7]), ("ddp-node", [0])])
def test_a_gpu_recipes_ranks_hold_what_plan_says(recipe: str, ranks: list[int]) -> None:
    rehearsal = rehearsed(recipe, ranks)
    assert rehearsal["world_size"] == 8
    assert_as_planned(rehearsal)
    assert rehearsal["ranks"][0]["collectives"]["allreduce"] >= 1  # the step decision's


@pytest.mark.matrix
@pytest.mark.parametrize(
    "recipe",
    [
        "single-gpu",
        "fsdp2-large-node",
        "fsdp2-float8-node",
        "fsdp2-multinode",
        "hsdp-multinode",
        "fsdp2-tp-multinode",
        "llama-1b-fsdp2-node",
        "llama-8b-fsdp2-node",
        "llama-8b-sft-fsdp2-node",
    ],
)
def test_every_gpu_recipe_of_the_library_rehearses_as_planned(recipe: str) -> None:
    assert_as_planned(rehearsed(recipe, [0]))
