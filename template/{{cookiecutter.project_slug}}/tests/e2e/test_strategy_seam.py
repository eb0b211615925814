"""A strategy family is one class and a registration: this file adds one and trains with it, changing no other module.

`python tests/e2e/test_strategy_seam.py train ...` is the command line with the toy strategy registered (Fabric
re-runs this script in each process it launches, so every rank registers it). The toy is ddp that clips
each gradient value instead of the global norm, so its updates differ from ddp's from the first step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import UNIT, read_csv_metrics, run_cli, train_args, train_losses

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.strategies import register
from {{ cookiecutter.package_name }}.strategies.ddp import DDP


class DDPValueClipping(DDP):
    """ddp whose step clips every gradient value to [-max_norm, max_norm]; it reports no gradient norm."""

    name = "ddp_value_clipping"

    def clip_and_step(self, fabric: Any, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor | None:
        if max_norm > 0:
            torch.nn.utils.clip_grad_value_(model.parameters(), max_norm)
        optimizer.step()
        return None


STEPS = 4 if UNIT == "token" else 12  # the image task's loss needs a few more steps to fall below its first
COMMON = ["--train.max_steps", str(STEPS), "--train.grad_clip", "0.01", "--eval.every_steps", "0"]


@pytest.mark.slow
def test_a_strategy_registered_outside_the_package_trains_through_the_same_loop(tmp_path: Path) -> None:
    toy = run_cli(
        *train_args(tmp_path / "toy", "--strategy.name", DDPValueClipping.name, *COMMON), script=Path(__file__)
    )
    assert toy.returncode == 0, toy.stderr[-3000:]
    ddp = run_cli(*train_args(tmp_path / "ddp", "--strategy.name", "ddp", *COMMON))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    toy_losses, ddp_losses = train_losses(tmp_path / "toy"), train_losses(tmp_path / "ddp")
    assert sorted(toy_losses) == sorted(ddp_losses) == list(range(1, STEPS + 1))
    assert toy_losses[1] == ddp_losses[1]  # same model, data and seed: only the update differs
    assert all(abs(toy_losses[step] - ddp_losses[step]) > 1e-6 for step in range(2, STEPS + 1))
    assert toy_losses[STEPS] < toy_losses[1]  # it learns
    # Its own clip_and_step ran: it reports no norm, where ddp's norm clipping logs one every step.
    assert not any(row.get("train/grad_norm") for row in read_csv_metrics(tmp_path / "toy"))
    assert any(row.get("train/grad_norm") for row in read_csv_metrics(tmp_path / "ddp"))


def test_an_unregistered_strategy_is_refused_naming_the_registered_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(train_args(Path("unused"), "--strategy.name", DDPValueClipping.name))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"strategy.name='{DDPValueClipping.name}' is not one of: ddp, fsdp2" in err


if __name__ == "__main__":
    register(DDPValueClipping)
    main(sys.argv[1:])
