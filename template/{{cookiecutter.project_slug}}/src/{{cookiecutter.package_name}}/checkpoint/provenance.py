"""What made a run: the project's code (git commit, whether the work tree differed from it and a digest of that
difference), the versions of python, torch, lightning, the task's key packages, CUDA and NCCL, the hosts of its
ranks and the launcher that started them.

Collected once per process (`local_provenance`: git and the package versions do not change under a running
process), written into every checkpoint's meta.json and the logger's config, read back by `checkpoint inspect`,
`report` and at resume, where `changes` names in one line what differs from the checkpoint. Git is not required:
without it (or outside a work tree, as in an installed wheel) the commit is null and `commit_unknown` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..recipe.schema import CheckpointConfig, Recipe, field_path
from .layout import read_meta
from .lock import launched_rank

PROVENANCE = "provenance"  # its key in meta.json and in the logger's config
LOGGED_FILE = "provenance.json"  # beside the CSV logger's config.yaml, one per process lifetime: `report` reads it
CORE_PACKAGES = ("torch", "lightning")  # every task's; a task adds its own (Task.key_packages)
GIT_SECONDS = 10  # a git call that takes longer (a network file system, a locked index) is given up
HOSTS_SHOWN = 8  # a job on hundreds of nodes names its first few
SOURCE = Path(__file__).resolve().parents[1]  # where the project's code is: its git work tree, when it has one


def local_provenance(key_packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """This process's code and versions (hosts and launcher are the run's: `run_provenance` adds them)."""
    return {**code_version(), "versions": dict(versions(key_packages))}  # a copy: the cached one stays as found


def run_provenance(key_packages: tuple[str, ...], hosts: list[str], launcher: str) -> dict[str, Any]:
    """What meta.json and the logger record: this process's code and versions, the hosts of all ranks (each once, in
    rank order) and the launcher."""
    return {**local_provenance(key_packages), "hosts": list(dict.fromkeys(hosts)), "launcher": launcher}


@functools.cache
def code_version() -> dict[str, Any]:
    """{commit, dirty, diff_sha256, commit_unknown}: the git commit of the project's code and whether tracked files
    differ from it (`git diff HEAD`: files git does not track are not code it knows of)."""
    unknown: dict[str, Any] = {"commit": None, "dirty": None, "diff_sha256": None}
    if shutil.which("git") is None:
        return {**unknown, "commit_unknown": "git is not installed"}
    try:
        commit = _git("rev-parse", "HEAD").decode().strip()
        diff = _git("diff", "HEAD", "--no-ext-diff", "--binary")
    except subprocess.CalledProcessError as error:  # no work tree, no commit yet, a repository git refuses to read
        said = error.stderr.decode(errors="replace").strip().splitlines()
        return {**unknown, "commit_unknown": f"git found no commit of {SOURCE}" + (f": {said[0]}" if said else "")}
    except (OSError, subprocess.TimeoutExpired) as error:
        return {**unknown, "commit_unknown": f"git did not answer ({type(error).__name__})"}
    digest = hashlib.sha256(diff).hexdigest() if diff else None
    return {"commit": commit, "dirty": bool(diff), "diff_sha256": digest, "commit_unknown": None}


def _git(*arguments: str) -> bytes:
    environment = {**os.environ, "LC_ALL": "C"}  # git's messages in English, as the recorded reason
    command = ["git", "-C", str(SOURCE), *arguments]
    return subprocess.run(command, capture_output=True, check=True, timeout=GIT_SECONDS, env=environment).stdout


@functools.cache
def versions(key_packages: tuple[str, ...] = ()) -> dict[str, str | None]:
    """python, torch, lightning and the task's packages (those installed), then cuda and nccl where torch has them."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in (*CORE_PACKAGES, *key_packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional package this installation does without
    import torch

    found["cuda"] = torch.version.cuda
    found["nccl"] = _nccl_version(torch)
    return found


def _nccl_version(torch: Any) -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def recorded(provenance: object) -> dict[str, Any] | None:
    """A provenance as a meta.json or provenance.json holds it, or None when it is not one: those files may come from
    anywhere (a copy, a hand edit), and each reader below takes the fields' types on trust."""
    if not isinstance(provenance, dict):
        return None
    versions, hosts = provenance.get("versions", {}), provenance.get("hosts") or []
    texts = [provenance.get(key) for key in ("commit", "diff_sha256", "commit_unknown", "launcher")]
    if not (isinstance(versions, dict) and isinstance(hosts, list)):
        return None
    if all(isinstance(text, str | None) for text in [*texts, *versions.values(), *hosts]):
        return provenance
    return None


def short_commit(provenance: dict[str, Any]) -> str:
    """`1a2b3c4`, `1a2b3c4-dirty` (as `git describe --dirty` says it), or `unknown`."""
    commit = provenance.get("commit")
    if not commit:
        return "unknown"
    return commit[:7] + ("-dirty" if provenance.get("dirty") else "")


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's provenance and this process's: `commit` (the commit or its diff), then
    each version that differs (`torch 2.13.0 -> 2.14.0`; `none` for a package on one side only)."""
    found = []
    if (saved.get("commit"), saved.get("diff_sha256")) != (now.get("commit"), now.get("diff_sha256")):
        found.append("commit")
    before, after = saved.get("versions", {}), now.get("versions", {})
    for name in dict.fromkeys([*before, *after]):
        if before.get(name) != after.get(name):
            found.append(f"{name} {before.get(name) or 'none'} -> {after.get(name) or 'none'}")
    return found


def change_line(step: int, saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """The one line a resume prints when its checkpoint was made by other code or packages, None when by the same:
    `resuming from step 40 of commit 1a2b3c4 (now 5d6e7f8-dirty); torch 2.13.0 -> 2.14.0`."""
    if saved is None:
        return f"resuming from step {step} of a checkpoint that records no provenance (saved by an older version)"
    found = changes(saved, now)
    if not found:
        return None
    line = f"resuming from step {step} of commit {short_commit(saved)}"
    if "commit" in found:
        same_commit = saved.get("commit") == now.get("commit")
        line += f" (now {'another diff' if same_commit else short_commit(now)})"
    return "; ".join([line, *(change for change in found if change != "commit")])


def describe(provenance: dict[str, Any]) -> list[str]:
    """Aligned lines for `checkpoint inspect` and `report`: the commit, the versions, the hosts, the launcher."""
    commit = provenance.get("commit")
    if not commit:
        code = f"unknown ({provenance.get('commit_unknown') or 'not recorded'})"
    elif provenance.get("dirty"):
        code = f"{commit}, dirty (diff sha256 {str(provenance.get('diff_sha256'))[:16]})"
    else:
        code = commit
    versions_said = ", ".join(f"{name} {value}" for name, value in provenance.get("versions", {}).items() if value)
    hosts = provenance.get("hosts") or []
    more = f" and {len(hosts) - HOSTS_SHOWN} more" if len(hosts) > HOSTS_SHOWN else ""
    return [
        f"commit       {code}",
        f"versions     {versions_said}",
        f"hosts        {', '.join(hosts[:HOSTS_SHOWN])}{more}",
        f"launcher     {provenance.get('launcher', 'unknown')}",
    ]


def check_resume(path: Path, recipe: Recipe, key_packages: tuple[str, ...]) -> None:
    """Before a resume starts anything: name in one line what made its checkpoint if that differs from this process
    (rank 0 prints it), or refuse it under checkpoint.on_provenance_change=error (RecipeError: exit 2)."""
    meta = read_meta(path, needs=("step",))  # complete by its files table, yet it may lack the step named here
    saved = recorded(meta.get(PROVENANCE))
    line: str | None
    if PROVENANCE in meta and saved is None:
        line = f"resuming from step {meta['step']} of a checkpoint whose provenance is not readable (not as saved)"
    else:
        line = change_line(meta["step"], saved, local_provenance(key_packages))
    if line is None:
        return
    option = field_path(CheckpointConfig, "on_provenance_change")
    if PROVENANCE in meta and recipe.checkpoint.on_provenance_change == "error":
        raise RecipeError(f"checkpoint {path}: {line} ({option}=error: set it to warn to resume all the same)")
    if launched_rank() == 0:
        print(f"warning: {line}", file=sys.stderr, flush=True)
