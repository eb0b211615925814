"""Reading checkpoints from disk without running code from them.

torch.distributed.checkpoint reads a sharded checkpoint's `.metadata` with pickle, and pickle can call
any function a file names: a crafted checkpoint would run code in `train` (resume), `checkpoint inspect`,
`consolidate`, `export`, `sample`/`predict`, on every rank. Before torch reads one, `check_metadata` unpickles it
with an unpickler that builds only what DCP's metadata is made of (its dataclasses, torch.Size, dtypes,
layouts, paths); anything else refuses the checkpoint in one line and nothing of it is called. Its data files
hold, beside tensors, values (an optimizer's param groups, a scheduler's state) that torch's reader unpickles with
`weights_only=False`: `check_values` reads each of them first with `weights_only=True` (`check_sharded` runs both
checks). Every other file is read with `torch.load(weights_only=True)` (tensors and plain containers only), whose
refusal becomes one line too (`load_tensors`).
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

from ..errors import RecipeError

METADATA = ".metadata"  # what torch.distributed.checkpoint's FileSystemWriter names it
# module -> the names a DCP .metadata pickle may use from it ("*": any class defined in that module)
ALLOWED = {
    "torch.distributed.checkpoint.metadata": "*",
    "torch.distributed.checkpoint.filesystem": "*",
    "torch.distributed.checkpoint.planner": "*",
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes (checked below)
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
MAX_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED.get(module)
        if allowed is not None and "." not in name:
            value = getattr(importlib.import_module(module), name, None)
            if allowed == "*" and isinstance(value, type) and value.__module__ == module:
                return value
            if name in allowed:
                return value
            import torch

            if module == "torch" and isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def check_metadata(state: Path) -> None:
    """Refuse a sharded checkpoint folder whose `.metadata` names anything but DCP's own metadata classes."""
    path = state / METADATA
    try:
        data = path.read_bytes() if path.stat().st_size <= MAX_METADATA_BYTES else b""
        _MetadataUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise RecipeError(
            f"checkpoint {state.parent}: {path.name} is missing (not a complete sharded checkpoint)"
        ) from None
    except Exception as error:  # pickle raises many kinds on a file that is not what it claims
        raise RecipeError(
            f"checkpoint {state.parent}: {path} is not a checkpoint's metadata and is not read ({error}); a checkpoint"
            " from an untrusted source can run code when loaded, see docs/failures-and-checkpoints.md (Checkpoints)"
        ) from None


def check_values(state: Path) -> None:
    """Refuse a sharded checkpoint folder (its metadata checked) whose non-tensor entries hold more than tensors and
    plain values, each read with `torch.load(weights_only=True)` in this process (they are small)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(state).read_metadata().state_dict_metadata
    planner = values_planner()
    values = {key: None for key, entry in metadata.items() if type(entry).__name__ == "BytesStorageMetadata"}
    if values:
        read_entries(values, state, planner)
    if planner.refused:
        raise RecipeError(
            f"checkpoint {state.parent}: entry {planner.refused[0]} holds more than tensors and plain values and is not"
            " read; a checkpoint from an untrusted source can run code when loaded, see docs/failures-and-checkpoints.md"
            " (Checkpoints)"
        )


def check_sharded(state: Path) -> None:
    """`check_metadata`, then `check_values`: what a sharded checkpoint folder must pass before torch reads it."""
    check_metadata(state)
    check_values(state)


def values_planner() -> Any:
    """A load planner of torch.distributed.checkpoint that reads non-tensor entries with `torch.load(weights_only=True)`
    (torch's own uses weights_only=False, which runs whatever code a crafted checkpoint names): what it reads lands in
    its `values`, the keys it refused in its `refused` (an error raised inside DCP's load would reach the caller
    wrapped in DCP's multi-line exception)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class ValuesPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.values: dict[str, Any] = {}
            self.refused: list[str] = []

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            try:
                self.values[key] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                self.refused.append(key)

    return ValuesPlanner()


def read_entries(entries: dict[str, Any], state: Path, planner: Any) -> None:
    """Read `entries` (key -> a tensor of its shape, or None for a value) from a DCP folder in this process only."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(entries, storage_reader=FileSystemReader(state), planner=planner, no_dist=True)


def load_tensors(path: Path, **options: Any) -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain containers only; anything else is one line."""
    import torch

    try:
        return torch.load(path, weights_only=True, **options)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(
            f"{path} holds more than tensors and is not read ({first[:200]}); a checkpoint from an untrusted source"
            " can run code when loaded with weights_only=False: do not"
        ) from None
