"""`rehearse` on the library's GPU recipes at their own size: what each rank holds is what `plan` says, to the byte."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "ranks"), [("fsdp2-node", [0, 7]), ("ddp-node", [0])])
def test_a_gpu_recipes_ranks_hold_plans_parameters_gradients_and_optimizer_state(recipe: str, ranks: list[int]) -> None:
    result = run_cli("rehearse", recipe, "--ranks", ",".join(map(str, ranks)), "--json")
    assert result.returncode == 0, result.stderr
    rehearsal = json.loads(result.stdout)
    assert rehearsal["world_size"] == 8 and [rank["rank"] for rank in rehearsal["ranks"]] == ranks
    plan = rehearsal["plan"]
    for rank in rehearsal["ranks"]:
        for held in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert rank[held] == plan[held], (rank["rank"], held)
        assert rank["collectives"]["allreduce"] >= 1
