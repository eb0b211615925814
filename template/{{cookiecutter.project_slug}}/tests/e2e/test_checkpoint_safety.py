"""A checkpoint from an untrusted source runs no code: a `.metadata` or RNG file, or a value in the sharded state's
data (an optimizer's param group), crafted to create a file when unpickled is refused in one line by every command that reads checkpoints (resume, inspect, consolidate,
export), and the file is never created. The checkpoints a run writes still load."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
from helpers import UNIT, run_cli, train_args

from {{ cookiecutter.package_name }}.checkpoint.layout import file_sha256

pytestmark = pytest.mark.slow

# No validation; the GPT exports in GPT-2's layout only with biases.
SETTINGS = ["--eval.every_steps", "0", *(["--model.bias", "true"] if UNIT == "token" else [])]


class Payload:
    """Unpickling this creates `marker` (as `open(marker, "w")` does): what a crafted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def craft(checkpoint: Path, relative: str, marker: Path) -> None:
    """Replace one file of a complete checkpoint with the payload, keeping meta.json's sizes consistent."""
    target = checkpoint / relative
    target.write_bytes(pickle.dumps({"model": Payload(marker)}))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][relative] = {"bytes": target.stat().st_size, "sha256": file_sha256(target)}  # as an attacker would
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def craft_value(checkpoint: Path, relative: str, marker: Path) -> None:
    """Rewrite the sharded state with its first optimizer param group's learning rate the payload (a value, which
    torch's reader unpickles with weights_only=False), keeping meta.json's sizes and digests consistent."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from {{ cookiecutter.package_name }}.checkpoint.safety import read_entries, values_planner

    state = checkpoint / "state"
    metadata = FileSystemReader(state).read_metadata().state_dict_metadata
    kinds = {key: isinstance(entry, TensorStorageMetadata) for key, entry in metadata.items()}
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in metadata.items() if kinds[key]
    }
    read_entries(tensors, state, None)
    planner = values_planner()
    read_entries({key: None for key in metadata if not kinds[key]}, state, planner)
    entries = {**tensors, **planner.values, "optimizer.param_groups.0.lr": Payload(marker)}
    for old in [*state.glob("*.distcp"), state / ".metadata"]:
        old.unlink()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(entries, storage_writer=FileSystemWriter(state), no_dist=True)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"] = {
        path.relative_to(checkpoint).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != "meta.json"
    }  # as an attacker would
    (checkpoint / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step fsdp2 run (sharded checkpoints at steps 1 and 2)."""
    out_dir = tmp_path_factory.mktemp("run")
    result = run_cli(*train_args(out_dir, "--train.max_steps", "2", "--checkpoint.save_every_steps", "1", *SETTINGS))
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


@pytest.mark.parametrize("relative", ["state/.metadata", "rng/rank-00000.pt", "state/meta.pt", "state/*.distcp"])
def test_a_crafted_checkpoint_runs_no_code_in_any_command(run: Path, tmp_path: Path, relative: str) -> None:
    import shutil

    out_dir = tmp_path / "run"
    shutil.copytree(run, out_dir)
    checkpoint = out_dir / "checkpoints" / "step-00000002"
    marker = tmp_path / "pwned"
    (craft_value if relative == "state/*.distcp" else craft)(checkpoint, relative, marker)
    commands = {
        "resume": train_args(out_dir, "--train.max_steps", "3", *SETTINGS),
        "inspect": ["checkpoint", "inspect", str(checkpoint)],
        "consolidate": ["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "weights.pt")],
        "export": ["export", str(checkpoint), str(tmp_path / "hf")],
        "compare": ["checkpoint", "compare", str(checkpoint), str(run / "checkpoints" / "step-00000002")],
    }
    readers = {
        "state/.metadata": commands,
        "rng/rank-00000.pt": ["resume"],
        "state/meta.pt": ["resume", "inspect", "consolidate"],
        "state/*.distcp": ["resume", "inspect", "consolidate", "compare"],
    }
    commands = {name: args for name, args in commands.items() if name in readers[relative]}  # the commands that read it
    for name, args in commands.items():
        result = run_cli(*args)
        assert result.returncode == 2, (name, result.stdout[-2000:], result.stderr[-3000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert errors and "is not read" in errors[0], (name, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (name, result.stderr[-3000:])
        assert not marker.exists(), name
    assert not (tmp_path / "weights.pt").exists()


def test_the_checkpoints_a_run_writes_still_load(run: Path, tmp_path: Path) -> None:
    result = run_cli("checkpoint", "consolidate", str(run), str(tmp_path / "weights.pt"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "weights.pt").is_file()


def test_consolidate_replaces_an_output_only_when_forced_and_never_inside_the_checkpoints(
    run: Path, tmp_path: Path
) -> None:
    output = tmp_path / "weights.pt"
    output.write_text("mine")
    refused = run_cli("checkpoint", "consolidate", str(run), str(output))
    assert refused.returncode == 2 and "exists" in refused.stderr and output.read_text() == "mine"
    forced = run_cli("checkpoint", "consolidate", str(run), str(output), "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    meta = run / "checkpoints" / "step-00000002" / "meta.json"
    before = meta.read_bytes()
    inside = run_cli("checkpoint", "consolidate", str(run), str(meta), "--force")
    assert inside.returncode == 2 and "where checkpoints live" in inside.stderr and meta.read_bytes() == before


def test_export_never_deletes_a_partial_folder_it_did_not_make(run: Path, tmp_path: Path) -> None:
    left = tmp_path / "hf.partial"
    left.mkdir()
    (left / "someone's file").write_text("keep")
    result = run_cli("export", str(run), str(tmp_path / "hf"))
    assert result.returncode == 2 and "hf.partial exists" in result.stderr
    assert (left / "someone's file").read_text() == "keep" and not (tmp_path / "hf").exists()


def test_a_checkpoint_config_whose_aliases_explode_is_refused_at_once(run: Path, tmp_path: Path) -> None:
    import shutil
    import time

    out_dir = tmp_path / "run"
    shutil.copytree(run, out_dir)
    checkpoint = out_dir / "checkpoints" / "step-00000002"
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (checkpoint / "config.yaml").write_text("\n".join(lines) + "\nmodel: *a8\n")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["config.yaml"] = {
        "bytes": (checkpoint / "config.yaml").stat().st_size,
        "sha256": file_sha256(checkpoint / "config.yaml"),
    }
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    started = time.perf_counter()
    result = run_cli("export", str(checkpoint), str(tmp_path / "hf"))
    assert result.returncode == 2 and "aliases expand it beyond" in result.stderr, result.stderr[-2000:]
    assert time.perf_counter() - started < 60  # not the minutes and gigabytes a full expansion takes


def test_a_shard_corrupted_in_place_is_found_by_its_digest_and_resume_auto_falls_back(
    run: Path, tmp_path: Path
) -> None:
    import shutil

    out_dir = tmp_path / "run"
    shutil.copytree(run, out_dir)
    damaged = out_dir / "checkpoints" / "step-00000002"
    shard = damaged / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped by the disk: the same size, so meta.json's sizes still match
    shard.write_bytes(bytes(data))
    why = f"checkpoint {damaged} is damaged: state/__1_0.distcp differ from the SHA-256 in its meta.json"

    explicit = run_cli(*train_args(out_dir, "--train.max_steps", "3", "--checkpoint.resume", str(damaged), *SETTINGS))
    assert explicit.returncode == 2, explicit.stderr[-3000:]
    assert f"error: {why}; resume from an older checkpoint" in explicit.stderr

    resumed = run_cli(*train_args(out_dir, "--train.max_steps", "3", *SETTINGS))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping {why}; resuming from step-00000001" in resumed.stderr
    assert "step-00000001 at step 1" in resumed.stdout
