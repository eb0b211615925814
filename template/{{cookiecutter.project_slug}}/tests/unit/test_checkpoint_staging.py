"""The host copy an async save stages into: reused across saves, never aliasing the live tensors, values fresh."""

from __future__ import annotations

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
