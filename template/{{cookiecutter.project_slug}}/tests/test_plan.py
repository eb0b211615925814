"""`plan RECIPE`: the training state per GPU of each strategy, and the strategy to pick (its estimates are checked
against real per-rank bytes in tests/test_strategies.py)."""

from __future__ import annotations

import re

import pytest
from helpers import RECIPES

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.plan import GIB, OPTIONS, state_bytes
from {{ cookiecutter.package_name }}.recipe.load import load_recipe

OPTION = {option.label: option for option in OPTIONS}


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, list[str]], str]:
    """The table rows by strategy, and the recommendation line."""
    main(["plan", *args])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(yes|no)$", line)
        if match:
            rows[match.group(1)] = list(match.groups()[1:])
    return rows, out.strip().splitlines()[-1]


def test_each_strategy_holds_its_share_of_16_bytes_per_parameter() -> None:
    n, ranks = 1_000_000, 8
    ddp = state_bytes(n, "32-true", OPTION["ddp"], ranks)
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (4 * n, 4 * n, 8 * n)
    assert state_bytes(n, "bf16-mixed", OPTION["fsdp2"], ranks).total == 16 * n / ranks  # fp32 master weights
    assert state_bytes(n, "bf16-true", OPTION["fsdp2"], ranks).total == 8 * n / ranks
    zero1 = state_bytes(n, "32-true", OPTION["deepspeed zero1"], ranks)
    assert (zero1.parameters, zero1.gradients, zero1.optimizer) == (4 * n, 4 * n, 8 * n / ranks)
    zero2 = state_bytes(n, "32-true", OPTION["deepspeed zero2"], ranks)
    assert (zero2.parameters, zero2.gradients, zero2.optimizer) == (4 * n, 4 * n / ranks, 8 * n / ranks)
    # DeepSpeed bf16: bf16 weights and gradients, fp32 master weights and moments (16 bytes) sharded.
    zero3 = state_bytes(n, "bf16-mixed", OPTION["deepspeed zero3"], ranks)
    assert zero3.total == (2 + 2 + 16) * n / ranks
    offload = state_bytes(n, "bf16-mixed", OPTION["deepspeed zero3 + cpu offload"], ranks)
    assert (offload.total, offload.host) == (2 * n / ranks, (2 + 16) * n / ranks)


def test_a_large_model_on_one_node_gets_fsdp2_and_a_small_one_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    rows, verdict = run_plan(capsys, "fsdp2-large-node")
    assert list(rows) == [option.label for option in OPTIONS]
    assert rows["ddp"][-1] == "no" and rows["fsdp2"][-1] == "yes"
    assert verdict.startswith("recommended: fsdp2 (recipe fsdp2-node)")
    # The same model with enough memory per GPU needs no sharding.
    _, verdict = run_plan(capsys, "fsdp2-large-node", "--gpu_memory_gib", "1000")
    assert verdict.startswith("recommended: ddp")


def test_when_only_offload_fits_it_is_recommended_and_when_nothing_fits_the_plan_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    recipe = load_recipe(RECIPES / "deepspeed-zero3-offload-multinode.yaml")
    rows, verdict = run_plan(capsys, "deepspeed-zero3-offload-multinode", "--gpu_memory_gib", "4")
    assert [label for label, row in rows.items() if row[-1] == "yes"] == ["deepspeed zero3 + cpu offload"]
    assert verdict.startswith(
        "recommended: deepspeed zero3 with CPU offload (recipe deepspeed-zero3-offload-multinode)"
    )
    assert recipe.num_nodes > 1
    _, verdict = run_plan(capsys, "deepspeed-zero3-offload-multinode", "--gpu_memory_gib", "0.5")
    assert verdict.startswith("nothing fits")


def test_the_table_reports_gib_per_gpu_from_the_recipes_model(capsys: pytest.CaptureFixture[str]) -> None:
    rows, _ = run_plan(capsys, "fsdp2-node")
    recipe = load_recipe(RECIPES / "fsdp2-node.yaml")
    from {{ cookiecutter.package_name }}.models import count_parameters

    expected = state_bytes(count_parameters(recipe.model), recipe.precision, OPTION["fsdp2"], recipe.world_size)
    assert float(rows["fsdp2"][3]) == pytest.approx(expected.total / GIB, abs=0.01)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu_memory_gib", "0"], "--gpu_memory_gib=0 must be > 0"),
        (["--headroom", "1"], "--headroom=1 must be in [0, 1)"),
    ],
)
def test_impossible_memory_settings_are_refused_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "fsdp2-node", *args])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
