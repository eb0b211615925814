"""Reading checkpoints from disk without running code from them.

torch.distributed.checkpoint reads a sharded checkpoint's `.metadata` with pickle, and pickle can call
any function a file names: a crafted checkpoint would run code in `train` (resume), `checkpoint inspect`,
`consolidate`, `export`, `sample`/`predict`, on every rank. Before torch reads one, `check_metadata` unpickles it
with an unpickler that builds only what DCP's metadata is made of (its dataclasses, torch.Size, dtypes,
layouts, paths); anything else refuses the checkpoint in one line and nothing of it is called. Every other
file is read with `torch.load(weights_only=True)` (tensors and plain containers only), whose refusal becomes
one line too (`load_tensors`).
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
