"""`checkpoint compare`: the first entry where two checkpoints differ and by how much, exit 0 equal / 1 different /
2 bad input; `checkpoint compare --fingerprints`: the first step where two runs' fingerprints part.

The checkpoints are written here as the project's sharded save lays them out (DCP's files in state/, the rest in
state/meta.pt, rng/, meta.json with every file's size and digest), in one process: no training run needed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import fail_with

from {{ cookiecutter.package_name }}.checkpoint.layout import file_sha256
from {{ cookiecutter.package_name }}.cli import main


def model_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "input.weight": torch.randn(4, 3, generator=generator),
        "blocks.0.fc.weight": torch.randn(8, 4, generator=generator),
        "head.weight": torch.randn(2, 8, generator=generator),
    }


def write_checkpoint(
    folder: Path,
    model: dict[str, torch.Tensor],
    step: int = 4,
    extra: object = None,
    learning_rate: float = 0.01,
    strategy: str = "fsdp2",
) -> Path:
    """A complete checkpoint folder of one process, as the project's save writes it: sharded (DCP's files, the rest
    in state/meta.pt; optimizer state by parameter name) or, for ddp, one state file (optimizer state by index)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    optimizer = {
        "state": {name: {"exp_avg": tensor * 0.1, "step": torch.tensor(float(step))} for name, tensor in model.items()},
        "param_groups": [{"lr": learning_rate, "betas": (0.9, 0.95), "params": list(model)}],
    }
    state = {"model": model, "optimizer": optimizer} | ({"extra": extra} if extra is not None else {})
    rest = {"step": step, "data": {"samples_seen": 8 * step}, "wandb_run_id": str(folder)}
    folder.mkdir(parents=True)
    if strategy == "ddp":
        optimizer["state"] = dict(enumerate(optimizer["state"].values()))
        optimizer["param_groups"][0]["params"] = list(range(len(model)))
        torch.save(state | rest, folder / "state")
    else:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            save(state, storage_writer=FileSystemWriter(folder / "state"), no_dist=True)
        torch.save(rest, folder / "state/meta.pt")
    (folder / "rng").mkdir()
    torch.save({"torch": torch.manual_seed(1).get_state()}, folder / "rng/rank-00000.pt")
    (folder / "config.yaml").write_text(f"out_dir: {folder}\n")  # differs between runs: not compared
    files = {
        str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    meta = {"step": step, "strategy": strategy, "world_size": 1, "time": 0.0, "files": files}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def compare(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, stdout) of `checkpoint compare ARGV` run in this process."""
    try:
        main(["checkpoint", "compare", *argv])
        code = 0
    except SystemExit as exited:
        code = int(exited.code or 0)
    return code, capsys.readouterr().out


def test_one_changed_element_is_named_with_its_difference_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = model_weights()
    changed["blocks.0.fc.weight"][3, 1] += 0.5
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    second = write_checkpoint(tmp_path / "b/step-00000004", changed)
    code, out = compare(capsys, str(first), str(second))
    assert code == 1
    difference = "first difference: model.blocks.0.fc.weight: 1 of 32 elements differ, max abs difference 0.5\n"
    assert difference in out
    assert "also optimizer.state.blocks.0.fc.weight.exp_avg: 1 of 32 elements differ" in out  # after the model
    assert "tensors and values equal, 2 differ" in out


def test_equal_checkpoints_of_two_runs_exit_0_and_a_run_names_its_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_checkpoint(tmp_path / "a/checkpoints/step-00000002", model_weights(), step=2)
    write_checkpoint(tmp_path / "a/checkpoints/step-00000004", model_weights())
    other = write_checkpoint(tmp_path / "b/step-00000004", model_weights())  # another run id, time and out_dir
    code, out = compare(capsys, str(tmp_path / "a"), str(other))
    assert code == 0, out
    assert f"A  {tmp_path / 'a/checkpoints/step-00000004'}" in out
    assert ", 0 differ" in out and "first difference" not in out


def test_a_compiled_blocks_wrapper_names_compare_as_the_models_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    compiled = {name.replace("blocks.0.", "blocks.0._orig_mod."): value for name, value in model_weights().items()}
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights(), strategy="ddp")
    second = write_checkpoint(tmp_path / "b/step-00000004", compiled, strategy="ddp")  # a module's state_dict keys
    assert compare(capsys, str(first), str(second))[0] == 0


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        (torch.zeros(8, 4, dtype=torch.float64), "model.blocks.0.fc.weight: dtype float32 in A, float64 in B"),
        (torch.zeros(4, 8), "model.blocks.0.fc.weight: shape (8, 4) in A, (4, 8) in B"),
    ],
    ids=["dtype", "shape"],
)
def test_a_dtype_or_shape_mismatch_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changed: torch.Tensor, said: str
) -> None:
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    second = write_checkpoint(tmp_path / "b/step-00000004", model_weights() | {"blocks.0.fc.weight": changed})
    code, out = compare(capsys, str(first), str(second))
    assert code == 1 and f"first difference: {said}\n" in out


def test_within_the_tolerance_is_equal_and_counters_still_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nudged = {name: tensor + 1e-4 for name, tensor in model_weights().items()}
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    second = write_checkpoint(tmp_path / "b/step-00000004", nudged)
    assert compare(capsys, str(first), str(second), "--tolerance", "1e-3")[0] == 0
    later = write_checkpoint(tmp_path / "c/step-00000005", model_weights(), step=5)
    code, out = compare(capsys, str(first), str(later), "--tolerance", "10")
    assert code == 1 and "first difference: step: 4 in A, 5 in B" in out


def test_a_param_group_value_and_a_ddp_checkpoint_against_a_sharded_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    other_rate = write_checkpoint(tmp_path / "b/step-00000004", model_weights(), learning_rate=0.02)
    code, out = compare(capsys, str(first), str(other_rate))
    assert code == 1 and "first difference: optimizer.param_groups.0.lr: 0.01 in A, 0.02 in B\n" in out
    # The optimizer state of ddp's checkpoint, keyed by index, is matched by name through the param groups.
    ddp = write_checkpoint(tmp_path / "c/step-00000004", model_weights(), strategy="ddp")
    code, out = compare(capsys, str(ddp), str(first))
    assert code == 1 and "first difference: meta.json.strategy: 'ddp' in A, 'fsdp2' in B\n" in out
    assert ", 1 differ" in out


class NotATensor:
    """What a crafted checkpoint could hold: an object whose unpickling would run code of its choosing."""


def test_an_entry_holding_an_object_is_refused_in_one_line_not_unpickled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    crafted = write_checkpoint(tmp_path / "b/step-00000004", model_weights(), extra=NotATensor())
    assert "entry extra holds more than tensors" in fail_with(
        ["checkpoint", "compare", str(first), str(crafted)], capsys
    )


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = write_checkpoint(tmp_path / "a/step-00000004", model_weights())
    (tmp_path / "empty").mkdir()
    compare_with = ["checkpoint", "compare", str(first)]
    assert "no such folder" in fail_with([*compare_with, str(tmp_path / "missing")], capsys)
    assert "no complete checkpoint there" in fail_with([*compare_with, str(tmp_path / "empty")], capsys)
    assert "--tolerance=-1.0: must be 0" in fail_with([*compare_with, str(first), "--tolerance", "-1"], capsys)
    assert "no fingerprints.jsonl there" in fail_with(
        ["checkpoint", "compare", "--fingerprints", *2 * [str(first)]], capsys
    )


def fingerprint_lines(steps: range, started_at: int = 0, loss_at_3: float = 0.75) -> list[str]:
    records: list[dict] = [{"started_at_step": started_at, "world_size": 2, "time": 0.0}]
    for step in steps:
        loss = loss_at_3 if step == 3 else 1.0 / step
        records.append({"step": step, "loss": loss, "grad_norm": 2.0, "params": f"{step:016x}"})
    return [json.dumps(record) for record in records]


def test_a_resumed_runs_fingerprints_agree_with_the_uninterrupted_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a/fingerprints.jsonl").write_text("\n".join(fingerprint_lines(range(1, 9))) + "\n")
    # Killed after step 6 while writing step 7's line, resumed from the checkpoint of step 4: steps 5-6 replayed.
    killed = [*fingerprint_lines(range(1, 7)), '{"step": 7, "lo']
    (tmp_path / "b/fingerprints.jsonl").write_text("\n".join([*killed, *fingerprint_lines(range(5, 9), 4)]) + "\n")
    code, out = compare(capsys, "--fingerprints", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0, out
    assert "steps 1-8, restarted at step 4" in out and "agree at all 8 steps" in out


def test_the_first_step_whose_fingerprints_differ_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(fingerprint_lines(range(1, 6))))
    second.write_text("\n".join(fingerprint_lines(range(1, 6), loss_at_3=0.5)))
    code, out = compare(capsys, "--fingerprints", str(first), str(second))
    assert code == 1
    assert "first divergence at step 3: loss 0.75 in A, 0.5 in B (difference 0.25)" in out
    assert "agree at the 2 steps both recorded before it (1-2)" in out
    assert compare(capsys, "--fingerprints", str(first), str(second), "--tolerance", "0.3")[0] == 0
