"""Save, find and resume checkpoints.

A checkpoint is a folder `<out_dir>/checkpoints/step-<step>/` holding `state` (written by
`fabric.save`: one file under ddp, a sharded torch.distributed.checkpoint folder under fsdp2), the
resolved recipe `config.yaml`, and `meta.json`. It is written under a temporary name and renamed
only after every rank has finished, so a folder with the final name is always complete.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric

from {{ cookiecutter.package_name }}.config import Recipe, RecipeError, dump_recipe

STEP_DIR = re.compile(r"^step-(\d+)$")
META_FILE = "meta.json"


def checkpoint_root(recipe: Recipe) -> Path:
    """The folder that holds all checkpoints of a run."""
    return Path(recipe.out_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    """Whether a checkpoint folder was fully written (its metadata is written last)."""
    return (path / META_FILE).is_file() and (path / "state").exists()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under root, oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in root.iterdir() if (match := STEP_DIR.match(path.name))]
    return [path for _, path in sorted(found) if is_complete(path)]


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(recipe: Recipe) -> Path | None:
    """The checkpoint a run continues from: null -> none, auto -> newest if any, else the given path."""
    resume = recipe.checkpoint.resume
    if resume is None:
        return None
    if resume == "auto":
        return find_latest(checkpoint_root(recipe))
    path = Path(resume)
    if not is_complete(path):
        raise RecipeError(
            f"checkpoint.resume={resume!r}: no complete checkpoint there (expected a folder such as"
            f" {checkpoint_root(recipe) / 'step-00000050'} with state and {META_FILE})"
        )
    return path


def save_checkpoint(fabric: Fabric, recipe: Recipe, state: dict[str, Any]) -> Path:
    """Save model, optimizer, scheduler, data position and counters; every rank writes its shard."""
    final = checkpoint_root(recipe) / f"step-{state['step']:08d}"
    partial = final.with_name(final.name + ".partial")
    if fabric.global_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    fabric.barrier()
    fabric.save(partial / "state", state)
    fabric.barrier()
    if fabric.global_rank == 0:
        (partial / "config.yaml").write_text(dump_recipe(recipe))
        meta = {
            "step": state["step"],
            "tokens_seen": state["tokens_seen"],
            "strategy": recipe.strategy.name,
            "world_size": fabric.world_size,
            "wandb_run_id": state.get("wandb_run_id"),
        }
        (partial / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    fabric.barrier()
    return final


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json (step, tokens seen, W&B run id, ...), readable before any process is launched."""
    return json.loads((path / META_FILE).read_text())


def load_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """Restore `state` in place from a checkpoint folder."""
    stateful = {key: value for key, value in state.items() if hasattr(value, "load_state_dict")}
    fabric.load(path / "state", state, weights_only=True)
    # Fabric's sharded (DCP) loader puts the saved dict in place of objects such as the LR
    # scheduler instead of calling their load_state_dict; restore those objects here.
    for key, value in stateful.items():
        if state[key] is not value:
            value.load_state_dict(state[key])
            state[key] = value
