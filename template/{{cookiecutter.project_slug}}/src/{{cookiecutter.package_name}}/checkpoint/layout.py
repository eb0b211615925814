"""Checkpoint folders on disk, without torch: their names, meta.json, whether one is complete, the newest
complete one, which one a run resumes from (checked before anything starts), and which one a command's
CHECKPOINT argument names (`resolve_checkpoint`: `sample`, `export`, `checkpoint inspect|consolidate`).

A checkpoint is `<out_dir>/checkpoints/step-<step>/` (see checkpoint.py for what it holds); it is
written as `step-<step>.partial` and renamed once every rank has finished, and meta.json (the size of
every file) is written last, so a folder with the final name whose files match meta.json is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..project import TASK
from ..recipe.registry import STRATEGIES, TASKS, task_for
from ..recipe.schema import Recipe
from .lock import launched_rank

STEP_DIR = re.compile(r"^step-(\d+)$")
META_FILE = "meta.json"
# Hugging Face's weight files: one, or several named by an index (every task's export writes them).
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_root(recipe: Recipe) -> Path:
    """The folder that holds all checkpoints of a run."""
    return Path(recipe.out_dir) / "checkpoints"


def problem_with(path: Path) -> str | None:
    """Why a checkpoint folder cannot be loaded, or None when it is complete (its files' sizes: cheap, for every
    folder; `damaged_files` compares their contents with the digests, for the one a run resumes from)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        return f"no {META_FILE} (the save did not finish)"
    except (OSError, ValueError) as error:
        return f"unreadable {META_FILE} ({error})"
    files = meta.get("files", {}) if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return f"{META_FILE} is not an object with a 'files' table (not a checkpoint's)"
    for name, record in files.items():
        try:
            size = file_record(record)[0]
        except (KeyError, TypeError, ValueError):
            return f"{META_FILE} records {name} as {str(record)[:60]!r}, not its size and sha256"
        file = path / name
        if not file.is_file():
            return f"missing {name}"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {META_FILE} says {size}"
    return None if (path / "state").exists() else "missing state"


def file_record(record: Any) -> tuple[int, str | None]:
    """(bytes, sha256 or None) of a file as meta.json records it (checkpoints of older versions hold sizes only)."""
    if isinstance(record, dict):
        return int(record["bytes"]), str(record["sha256"])
    return int(record), None


def file_sha256(path: Path, sync: bool = False) -> str:
    """Hex SHA-256 of a file, read in 8 MiB pieces; with `sync`, its data is also flushed to the disk (fsync)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def damaged_files(path: Path, names: list[str]) -> list[str]:
    """Which of a complete checkpoint's files (`names`) differ from the SHA-256 its meta.json records."""
    files = read_meta(path).get("files", {})
    damaged = []
    for name in names:
        recorded = file_record(files[name])[1]
        if recorded is not None and file_sha256(path / name) != recorded:
            damaged.append(name)
    return damaged


def checkpoint_recipe(path: Path) -> Recipe:
    """The recipe a checkpoint folder was saved with. What its task says may be gone since (the language model's
    model.init_from: the weights are in the checkpoint now, the folder they first came from may not be; unless
    LoRA adapted them, whose checkpoints hold the adapters only) is not checked again."""
    from ..recipe.load import parse_recipe, read_recipe_file  # jsonargparse: only when asked

    saved = read_recipe_file(path / "config.yaml", f"checkpoint {path}: config.yaml") or {}  # bounded, as any recipe
    task = TASKS(saved.get("task", TASK))
    return parse_recipe(["--config", str(path / "config.yaml"), *task.saved_recipe_overrides(saved)])


# What a checkpoint holds per parameter, when none of the run's shows it yet: fp32 weights and AdamW's two moments.
BYTES_PER_PARAMETER = 12


def checkpoint_bytes(recipe: Recipe) -> int:
    """About how many bytes the run's next checkpoint takes: its newest checkpoint's size, else from the model."""
    newest = find_latest(checkpoint_root(recipe))
    if newest is not None:
        return sum(file_record(record)[0] for record in read_meta(newest).get("files", {}).values())
    task = task_for(recipe)
    if (saved := task.checkpointed_parameters()) is not None:  # adapters: the frozen base is not saved
        return saved * BYTES_PER_PARAMETER
    cost = task.model_cost()
    return cost.parameters() * BYTES_PER_PARAMETER if cost is not None else 0


def space_report(recipe: Recipe) -> str:
    """`120.0 MiB free on the disk of <out_dir>, a checkpoint of this run takes about 1.4 GiB`."""
    free, needed = free_bytes(Path(recipe.out_dir)), checkpoint_bytes(recipe)
    return f"{_size(free)} free on the disk of {recipe.out_dir}, a checkpoint of this run takes about {_size(needed)}"


def check_free_space(recipe: Recipe) -> None:
    """Refuse to start a run whose out_dir cannot hold one more checkpoint (measured, or estimated from the model)."""
    if free_bytes(Path(recipe.out_dir)) < checkpoint_bytes(recipe):
        raise RecipeError(
            f"out_dir={recipe.out_dir!r}: {space_report(recipe)}: free space there, or choose another out_dir"
        )


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or would: its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


@contextlib.contextmanager
def removed_unless_finished(partial: Path) -> Iterator[Path]:
    """Run a command's writing of `partial` (a `.partial` file or folder it created); if the block fails or the
    process is asked to stop (SIGTERM: a scheduler's or a user's `kill`, turned into an exit with status 143),
    remove `partial`, so that an interrupted command leaves nothing behind that would block its rerun."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_terminate)
    try:
        yield partial
    except BaseException:
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup above, with the shell's status for a TERM


def new_partial(target: Path) -> Path:
    """`<target>.partial`, created empty for a command to write into and rename to `target` when complete. One that
    exists is not this command's (an interrupted run's, or someone else's): it is refused, never deleted."""
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        raise RecipeError(f"{partial} exists (left by an interrupted run?): look inside, delete it, then run again")
    partial.mkdir(parents=True)
    return partial


def read_meta(path: Path, needs: tuple[str, ...] = ()) -> dict[str, Any]:
    """The metadata of a complete checkpoint (`problem_with` has read it), with the keys its reader `needs`: one
    line when one is missing or the file is not an object."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as error:
        raise RecipeError(f"checkpoint {path}: unreadable {META_FILE} ({error})") from None
    if not isinstance(meta, dict):
        raise RecipeError(f"checkpoint {path}: {META_FILE} is not a JSON object (not a checkpoint's)")
    if missing := [key for key in needs if not isinstance(meta.get(key), str | int) or isinstance(meta[key], bool)]:
        raise RecipeError(f"checkpoint {path}: {META_FILE} has no {missing[0]!r} (not a complete checkpoint's)")
    return meta


def scan_checkpoints(root: Path) -> tuple[list[Path], dict[Path, str]]:
    """(complete checkpoint folders oldest first, {folder that is not complete: why}) under root.

    A `.partial` folder is a save that was interrupted (the job died while writing): expected after
    a kill, never loaded. A folder with its final name whose files do not match meta.json is damaged
    (a node died after the rename, a disk filled up): it too is never loaded.
    """
    complete, not_complete = [], {}
    if root.is_dir():
        for path in root.iterdir():
            if match := STEP_DIR.match(path.name):
                problem = problem_with(path)
                if problem is None:
                    complete.append((int(match.group(1)), path))
                else:
                    not_complete[path] = problem
            elif path.name.endswith(".partial") and STEP_DIR.match(path.name.removesuffix(".partial")):
                not_complete[path] = "unfinished save"
    return [path for _, path in sorted(complete)], not_complete


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under root, oldest first."""
    return scan_checkpoints(root)[0]


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed first, so a job killed during the delete leaves no half folder
    under a checkpoint's name (seen in scripts/soak.sh: a kill inside retention's delete left
    `step-N/` holding config.yaml and rng/ only, listed as damaged ever after)."""
    if path.exists():
        doomed = path.with_name(path.name + ".deleting")
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_old_checkpoints(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; finish deletes that a killed job left behind."""
    for old in list_checkpoints(root)[:-keep_last]:
        remove_checkpoint(old)
    for leftover in root.glob("step-*.deleting"):
        shutil.rmtree(leftover, ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def checkpoints_folder(path: Path) -> Path:
    """The folder holding a run's checkpoints, given the run's out_dir or that folder itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def resolve_checkpoint(name: str) -> Path:
    """The checkpoint folder a command's CHECKPOINT argument names: a step folder (`step-N`) as it is, or the newest
    complete checkpoint of a run's out_dir or of its checkpoints/ folder (`<...>/latest` reads as its folder).

    Refused in one line naming the argument and what is wrong (RecipeError): no such folder, a step folder
    whose save did not finish or is damaged, a run with no complete checkpoint (its incomplete ones named).
    """
    path = Path(name)
    if path.name == "latest" and not (path / META_FILE).is_file():
        path = path.parent
    if not path.is_dir():
        raise RecipeError(
            f"checkpoint {name!r}: no complete checkpoint there: no such folder (a step folder, checkpoints/, or a run)"
        )
    if (path / META_FILE).is_file() or STEP_DIR.match(path.name.removesuffix(".partial")):
        unfinished = "unfinished save" if path.name.endswith(".partial") else None
        if problem := problem_with(path) or unfinished:
            raise RecipeError(f"checkpoint {name!r}: not a complete checkpoint: {problem}")
        return path
    complete, not_complete = scan_checkpoints(checkpoints_folder(path))
    if not complete:
        found = "; ".join(f"{folder.name} ({why})" for folder, why in sorted(not_complete.items()))
        raise RecipeError(
            f"checkpoint {name!r}: no complete checkpoint there (a step folder, checkpoints/, or a run)"
            + (f"; not complete: {found}" if found else "")
        )
    return complete[-1]


def resolve_resume(recipe: Recipe) -> Path | None:
    """The checkpoint a run continues from: null -> none, auto -> newest complete one if any, else the given path.

    Refused before anything starts: an explicit path that is not a complete checkpoint, `auto` when
    the only checkpoints there are damaged (starting over would silently throw the run away), and a
    checkpoint of another model shape. Skipped folders are named in one line (rank 0).
    """
    resume = recipe.checkpoint.resume
    if resume is None:
        return None
    if resume == "auto":
        root = checkpoint_root(recipe)
        complete, not_complete = scan_checkpoints(root)
        damaged = {path: why for path, why in not_complete.items() if not path.name.endswith(".partial")}
        if damaged and not complete:
            names = "; ".join(f"{path.name} ({why})" for path, why in sorted(damaged.items()))
            raise RecipeError(
                f"checkpoint.resume=auto: no complete checkpoint under {root}, only damaged ones: {names}."
                " To start afresh on purpose, choose another out_dir or pass --checkpoint.resume null"
            )
        path = complete[-1] if complete else None
        skipped = sorted(p for p in not_complete if path is None or step_of(p) > step_of(path))
        if skipped and launched_rank() == 0:
            kind = {True: "unfinished", False: "incomplete"}
            said = "; ".join(
                f"skipping {kind[p.name.endswith('.partial')]} checkpoint {p}: {not_complete[p]}" for p in skipped
            )
            print(f"{said}; resuming from {path.name if path else 'step 0 (nothing was saved yet)'}", file=sys.stderr)
    else:
        path = Path(resume)
        if not path.is_dir():
            raise RecipeError(f"checkpoint.resume={resume!r}: no such checkpoint folder")
        if problem := problem_with(path):
            raise RecipeError(f"checkpoint.resume={resume!r}: not a complete checkpoint: {problem}")
    if path is not None:
        check_same_model(path, recipe)
        check_readable_layout(path, recipe)
    return path


def step_of(path: Path) -> int:
    """The step of a checkpoint folder's name (`step-N`, `step-N.partial`); -1 for another name."""
    match = STEP_DIR.match(path.name.removesuffix(".partial"))
    return int(match.group(1)) if match else -1


def check_readable_layout(path: Path, recipe: Recipe) -> None:
    """Refuse to resume a checkpoint this run's strategy cannot read: one in a strategy's own layout (DeepSpeed's,
    FSDP1's) under another strategy, or the other way. torch.distributed.checkpoint's sharded layout reshards onto
    any fsdp2/hsdp degree (tensor, pipeline, expert, context parallel), and a ddp checkpoint and a sharded one read
    each other (checkpoint/load.py)."""
    saved, here = read_meta(path).get("strategy"), recipe.strategy.name
    if not isinstance(saved, str) or saved not in STRATEGIES.classes:  # loading it names what is wrong
        return
    layouts = {name: STRATEGIES(name).checkpoint_layout for name in (saved, here)}
    if saved != here and "own" in layouts.values():
        raise RecipeError(
            f"checkpoint {path} was saved by strategy.name={saved}, whose layout strategy.name={here} cannot read"
            f" ({saved}: {layouts[saved]}, {here}: {layouts[here]}): resume it with strategy.name={saved}, or start"
            " afresh in another out_dir or with --checkpoint.resume null"
        )


def check_same_model(path: Path, recipe: Recipe) -> None:
    """Refuse to resume a checkpoint of another model shape, naming the fields that differ."""
    saved_file = path / "config.yaml"
    if not saved_file.is_file():
        return
    from ..recipe.load import read_recipe_file  # bounded: a checkpoint's config.yaml is a recipe like any

    saved = (read_recipe_file(saved_file, f"checkpoint {path}: config.yaml") or {}).get("model", {})
    current = recipe.to_dict()["model"]
    resumable = task_for(recipe).resumable_model_changes()  # fields that do not change the saved tensors' shapes
    compared = [key for key in current if key in saved and key not in resumable]
    differ = [
        f"model.{key}={saved[key]!r} there, {current[key]!r} here" for key in compared if saved[key] != current[key]
    ]
    if differ:
        raise RecipeError(
            f"checkpoint {path} was saved for another model ({', '.join(differ)}): resume it with the same model"
            " settings, or start afresh in another out_dir or with --checkpoint.resume null"
        )
