"""Async saves: the host copy they stage into (reused, never aliasing the live tensors, values fresh), and
the per-step poll, which never waits in a collective another rank may not be in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoint.io import HostCopy


def live_state() -> dict:
    weight, moment = torch.randn(4, 3), torch.randn(4, 3)
    return {
        "model": {"weight": weight},
        "optimizer": {
            "state": {"weight": {"exp_avg": moment, "step": torch.tensor(1.0)}},
            "param_groups": [{"lr": 0.1}],
        },
    }


def test_later_saves_copy_into_the_first_saves_host_tensors_and_take_other_values_fresh() -> None:
    state = live_state()
    stager = HostCopy(pinned=False)
    first = stager.stage(state)
    assert torch.equal(first["model"]["weight"], state["model"]["weight"])
    assert first["model"]["weight"].data_ptr() != state["model"]["weight"].data_ptr()  # a copy, not the live tensor

    with torch.no_grad():  # a training step changes the tensors in place and the schedule changes the lr
        state["model"]["weight"].add_(1.0)
        state["optimizer"]["state"]["weight"]["exp_avg"].mul_(2.0)
        state["optimizer"]["state"]["weight"]["step"] += 1
    state["optimizer"]["param_groups"][0]["lr"] = 0.05
    second = stager.stage(state)

    pairs = [
        (second["model"]["weight"], state["model"]["weight"], first["model"]["weight"]),
        (
            second["optimizer"]["state"]["weight"]["exp_avg"],
            state["optimizer"]["state"]["weight"]["exp_avg"],
            first["optimizer"]["state"]["weight"]["exp_avg"],
        ),
        (
            second["optimizer"]["state"]["weight"]["step"],
            state["optimizer"]["state"]["weight"]["step"],
            first["optimizer"]["state"]["weight"]["step"],
        ),
    ]
    for staged, live, earlier in pairs:
        assert torch.equal(staged, live)
        assert staged.data_ptr() == earlier.data_ptr()  # the same host memory, no new allocation
        assert staged.data_ptr() != live.data_ptr()
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.05

    snapshot = second["model"]["weight"].clone()
    with torch.no_grad():  # training goes on while the background write reads the staged copy
        state["model"]["weight"].add_(1.0)
    assert torch.equal(second["model"]["weight"], snapshot)


def test_a_reshaped_tensor_is_staged_afresh() -> None:
    state = live_state()
    stager = HostCopy(pinned=False)
    stager.stage(state)
    state["model"]["weight"] = torch.randn(5, 3)
    state["model"]["bias"] = torch.randn(5)
    staged = stager.stage(state)
    assert torch.equal(staged["model"]["weight"], state["model"]["weight"])
    assert torch.equal(staged["model"]["bias"], state["model"]["bias"])


def test_poll_enters_no_collective_when_a_background_save_finished_on_this_rank_only(tmp_path, monkeypatch) -> None:
    """A rank whose save finished first must not wait in a barrier while the others run the next step."""
    from concurrent.futures import Future

    from lightning.fabric import Fabric

    from {{ cookiecutter.package_name }}.checkpoint.io import Checkpointer
    from {{ cookiecutter.package_name }}.recipe.load import load_recipe

    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "cpu-debug.yaml")
    recipe.out_dir = str(tmp_path)
    fabric = Fabric(accelerator="cpu", devices=1)
    checkpointer = Checkpointer(fabric, recipe)
    barriers: list[int] = []
    monkeypatch.setattr(fabric, "barrier", lambda *args, **kwargs: barriers.append(1))
    finished: Future[None] = Future()
    finished.set_result(None)
    checkpointer._pending = finished

    checkpointer.poll()
    assert barriers == []  # the finished save waits for the barrier every rank reaches together
    checkpointer.wait()
    assert barriers == [1]

    failed: Future[None] = Future()
    failed.set_exception(RuntimeError("a shard could not be written"))
    checkpointer._pending = failed
    with pytest.raises(RuntimeError, match="could not be written"):
        checkpointer.poll()  # a failure is raised at once, before any barrier
    assert barriers == [1]
