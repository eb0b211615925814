"""Two checkpoints compared entry by entry: the first that differs, by how much, and how many are equal.

For finding where two runs part (a resumed run against an uninterrupted one, one layout against another): every
tensor and value of both folders is read without a process group and without running code from them (DCP's
metadata through checkpoint/safety.py, every other object with `torch.load(weights_only=True)`), and compared in
one stable order: the model, the optimizer state, then the rest (scheduler, data position, counters, each rank's
random number state, meta.json). Within each, the order the first checkpoint wrote them in (the model's own
order: a difference in an early layer is named before one in a later). Sharded tensors are read a batch at a time,
so two checkpoints larger than memory can be compared.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import RecipeError
from .layout import META_FILE
from .safety import METADATA, check_sharded, load_tensors, read_entries, values_planner
from .tensors import WRAPPER_PREFIXES

# Sharded tensors read at once (of each checkpoint): bounds the memory a comparison of two large checkpoints takes.
BATCH_BYTES = 1 << 30
EXTRA_STATE_FILE = "meta.pt"  # what Lightning's sharded save writes beside the tensors: scheduler, data, counters
# What differs between any two runs, however alike their training: not compared.
NOT_COMPARED = ("wandb_run_id", "time", "provenance", "files")
SHOWN_DIFFERENCES = 10  # differing entries listed after the first


@dataclass(frozen=True)
class Stored:
    """A tensor of a sharded checkpoint not read yet: its key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return max(1, torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass
class Comparison:
    """What `compare_checkpoints` found: entries equal, and (name, how) of each that differs, in order."""

    equal: int = 0
    differences: list[tuple[str, str]] = field(default_factory=list)

    def lines(self, first: Path, second: Path) -> list[str]:
        """What `checkpoint compare` prints."""
        lines = [f"A  {first}", f"B  {second}"]
        if self.differences:
            name, how = self.differences[0]
            lines.append(f"first difference: {name}: {how}")
            lines += [f"  also {name}: {how}" for name, how in self.differences[1 : SHOWN_DIFFERENCES + 1]]
            if len(self.differences) > SHOWN_DIFFERENCES + 1:
                lines.append(f"  ... and {len(self.differences) - SHOWN_DIFFERENCES - 1} more")
        lines.append(
            f"{self.equal} tensors and values equal, {len(self.differences)} differ"
            f" (not compared: {', '.join(NOT_COMPARED)})"
        )
        return lines


def compare_checkpoints(first: Path, second: Path, tolerance: float = 0.0) -> Comparison:
    """Every entry of two checkpoint folders compared, bitwise (tolerance 0) or to an absolute tolerance."""
    entries = [checkpoint_entries(first), checkpoint_entries(second)]
    entries = _optimizer_indices_named(*entries)
    names = list(entries[0]) + [name for name in entries[1] if name not in entries[0]]
    names.sort(key=_section)  # stable: the first checkpoint's order within each section
    comparison = Comparison()
    for batch in _batches(names, entries):
        values = [_read(path / "state", found, batch) for path, found in zip((first, second), entries, strict=True)]
        for name in batch:
            how = _difference(values[0].get(name, _MISSING), values[1].get(name, _MISSING), tolerance)
            if how is None:
                comparison.equal += 1
            else:
                comparison.differences.append((name, how))
    return comparison


def checkpoint_entries(path: Path) -> dict[str, Any]:
    """Name -> value (a `Stored` tensor of a sharded checkpoint, read later) of everything a checkpoint folder holds."""
    state = path / "state"
    if (state / METADATA).is_file():
        entries = _sharded_entries(state)
        if (state / EXTRA_STATE_FILE).is_file():
            entries.update(_flattened(_comparable(load_tensors(state / EXTRA_STATE_FILE))))
    elif state.is_file():
        entries = dict(_flattened(_comparable(load_tensors(state, map_location="cpu", mmap=True))))
    else:
        raise RecipeError(
            f"checkpoint {path}: no {state.name}/{METADATA} nor {state.name} file: compare reads the whole (torch.save)"
            " and torch.distributed.checkpoint layouts"
        )
    for rng_file in sorted((path / "rng").glob("*.pt")):
        entries.update(_flattened(load_tensors(rng_file), f"rng.{rng_file.stem}"))
    entries.update(_flattened(_comparable(json.loads((path / META_FILE).read_text())), META_FILE))
    return {_without_wrappers(name): value for name, value in entries.items()}


def _without_wrappers(name: str) -> str:
    """A name as the model's own (a compiled or activation-checkpointed block's wrappers left out), so that runs
    with and without them compare."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _comparable(saved: Any) -> Any:
    """A checkpoint's top-level table without what differs between any two runs (NOT_COMPARED)."""
    return {key: value for key, value in saved.items() if key not in NOT_COMPARED} if isinstance(saved, dict) else saved


OPTIMIZER_STATE, PARAM_GROUPS = "optimizer.state.", "optimizer.param_groups."


def _optimizer_indices_named(first: dict[str, Any], second: dict[str, Any]) -> list[dict[str, Any]]:
    """Both checkpoints' entries, a plain optimizer's state (ddp's: keyed by parameter index) renamed by the other's
    parameter names (a sharded optimizer's), matched through their param groups' order as a ddp -> fsdp2 resume
    matches them; unchanged unless one checkpoint has indices and the other names."""
    params = [_grouped_params(found) for found in (first, second)]
    for indexed, named in ((0, 1), (1, 0)):
        indices, names = params[indexed], params[named]
        if len(indices) != len(names) or not all(isinstance(index, int) for index in indices):
            continue
        if not all(isinstance(name, str) for name in names):
            continue
        by_index = {str(index): name for index, name in zip(indices, names, strict=True)}
        renamed = {}
        for name, value in (first, second)[indexed].items():
            if name.startswith(OPTIMIZER_STATE):
                index, _, rest = name.removeprefix(OPTIMIZER_STATE).partition(".")
                name = f"{OPTIMIZER_STATE}{by_index.get(index, index)}.{rest}"
            elif name.startswith(PARAM_GROUPS) and name.endswith(".params"):
                value = [by_index.get(str(index), index) for index in value]
            renamed[name] = value
        return [renamed, second] if indexed == 0 else [first, renamed]
    return [first, second]


def _grouped_params(entries: dict[str, Any]) -> list[Any]:
    """The parameters (indices or names) of every param group of an optimizer's state, in order."""
    return [
        param
        for name, value in entries.items()
        if name.startswith(PARAM_GROUPS) and name.endswith(".params") and isinstance(value, list)
        for param in value
    ]


def _sharded_entries(state: Path) -> dict[str, Any]:
    """The entries of a DCP folder: tensors as `Stored`, the (small) other values read at once."""
    check_sharded(state)  # before torch's reader unpickles anything of it
    metadata = FileSystemReader(state).read_metadata().state_dict_metadata
    entries: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, entry in metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            entries[key] = Stored(key, tuple(entry.size), entry.properties.dtype)
        else:
            entries[key] = values[key] = None
    if values:
        planner = values_planner()
        read_entries(values, state, planner)
        entries.update(planner.values)
    return entries


def _flattened(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) of nested dicts, and of lists and tuples holding dicts or tensors (an optimizer's param
    groups); a list of plain values (a random number state of 625 integers) is one leaf. Numpy arrays become tensors."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, torch.Tensor)) for item in value):
        items = enumerate(value)
    else:
        leaf = (
            torch.from_numpy(value.copy()) if type(value).__module__ == "numpy" and hasattr(value, "dtype") else value
        )
        yield prefix, leaf
        return
    for key, item in items:
        yield from _flattened(item, f"{prefix}.{key}" if prefix else str(key))


def _section(name: str) -> int:
    """The model first, then the optimizer's state, then everything else."""
    return 0 if name.startswith("model.") else 1 if name.startswith("optimizer.") else 2


def _batches(names: list[str], entries: list[dict[str, Any]]) -> Iterator[list[str]]:
    """`names` in order, cut where the sharded tensors to read exceed BATCH_BYTES."""
    batch: list[str] = []
    size = 0
    for name in names:
        stored = [found[name] for found in entries if isinstance(found.get(name), Stored)]
        size += max((tensor.bytes for tensor in stored), default=0)
        batch.append(name)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _read(state: Path, entries: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The values of `names` in one checkpoint, its stored tensors read in one pass."""
    values = {name: entries[name] for name in names if name in entries}
    stored = {name: value for name, value in values.items() if isinstance(value, Stored)}
    if stored:
        tensors = {value.key: torch.empty(value.shape, dtype=value.dtype) for value in stored.values()}
        read_entries(tensors, state, None)
        values.update({name: tensors[value.key] for name, value in stored.items()})
    return values


_MISSING = object()
_SAME_SIZE_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _difference(first: Any, second: Any, tolerance: float) -> str | None:
    """How two entries differ, in words; None when they are equal."""
    if first is _MISSING or second is _MISSING:
        return "only in A" if second is _MISSING else "only in B"
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return _tensor_difference(first, second, tolerance)
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return f"{type(first).__name__} in A, {type(second).__name__} in B"
    floats = isinstance(first, float) or isinstance(second, float)  # counters (int) are compared exactly
    if (
        floats
        and all(isinstance(value, (int, float)) for value in (first, second))
        and abs(first - second) <= tolerance
    ):
        return None
    return None if first == second else f"{_short(first)} in A, {_short(second)} in B"


def _tensor_difference(first: torch.Tensor, second: torch.Tensor, tolerance: float) -> str | None:
    if first.dtype != second.dtype:
        return f"dtype {_dtype(first)} in A, {_dtype(second)} in B"
    if first.shape != second.shape:
        return f"shape {tuple(first.shape)} in A, {tuple(second.shape)} in B"
    differ = _differing_elements(first.reshape(-1), second.reshape(-1), tolerance)
    count = int(differ.sum())
    if count == 0:
        return None
    gaps = (first.reshape(-1)[differ].double() - second.reshape(-1)[differ].double()).abs()
    return f"{count:,} of {first.numel():,} elements differ, max abs difference {float(gaps.max()):.6g}"


def _differing_elements(first: torch.Tensor, second: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Which elements differ: by their bits when the tolerance is 0 (a NaN equals the same NaN, -0.0 differs from
    0.0), else floating-point values by more than the tolerance."""
    if tolerance > 0 and first.is_floating_point():
        return ~torch.isclose(first, second, rtol=0.0, atol=tolerance, equal_nan=True)
    if first.dtype == torch.bool:
        return first != second
    bits = _SAME_SIZE_INTEGERS.get(first.element_size())
    return first != second if bits is None else first.view(bits) != second.view(bits)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
