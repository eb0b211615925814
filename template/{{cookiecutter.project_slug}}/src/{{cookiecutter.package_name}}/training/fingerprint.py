"""Per-step fingerprints (`logger.fingerprint: true`): where two runs part, to the step.

Every optimizer step, rank 0 appends one JSON line to `<out_dir>/fingerprints.jsonl`:

    {"step": 12, "loss": 0.8231..., "grad_norm": 1.094..., "params": "9f3c0e1a52b7d6e4"}

`loss` is the mean of the ranks' step losses (summed in rank order, in float64), `grad_norm` the clipped update's
total norm (null for a skipped update), `params` a hash of the parameters after the update: each rank hashes the
bytes of its own parameter shards (BLAKE2b), and rank 0 hashes the ranks' digests in rank order. So two runs
with the same layout have equal hashes exactly when every rank's parameters are bitwise equal; runs on different
layouts (processes, strategy) hash differently even when their weights agree: compare their checkpoints instead.

Each start of a run appends a line `{"started_at_step": N}` first; a resumed run replays the steps after its
checkpoint, and a step's last line is the one that counts (`read_fingerprints`).

Cost, only when on: every rank copies its parameter shards to host memory and hashes them each step (BLAKE2b
runs at about 1 GB/s per core: a 1 GB shard adds about a second a step), and one all_gather of 16 bytes per rank.
A debugging tool, then: leave it off for production runs, turn it on to find where two runs part.

Reading and comparing fingerprints needs no torch (it is imported where a step is recorded), so
`checkpoint compare --fingerprints` answers at once.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError

if TYPE_CHECKING:
    import torch
    from lightning.fabric import Fabric

FINGERPRINTS_FILE = "fingerprints.jsonl"
COMPARED = ("loss", "grad_norm", "params")


class Fingerprints:
    """Writes one fingerprint line per optimizer step (every rank calls `record`; rank 0 writes)."""

    def __init__(self, fabric: Fabric, out_dir: str | Path, start_step: int) -> None:
        self.fabric = fabric
        self.path = Path(out_dir) / FINGERPRINTS_FILE
        self._write({"started_at_step": start_step, "world_size": fabric.world_size, "time": time.time()})

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, model: torch.nn.Module) -> None:
        """Hash this rank's parameters, gather (loss, hash) from every rank in one all_gather, write the step."""
        import torch

        norm = None
        if grad_norm is not None:  # a DTensor under FSDP2: its full value takes a collective, so every rank asks
            norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_bits = loss.detach().to(torch.float64).reshape(1).view(torch.int64)
        mine = torch.cat([loss_bits, torch.tensor([parameter_hash(model)], device=loss_bits.device)])
        gathered = self.fabric.all_gather(mine)
        if self.fabric.global_rank != 0:
            return
        per_rank = torch.as_tensor(gathered).reshape(-1, 2).cpu()
        losses = per_rank[:, 0].contiguous().view(torch.float64).tolist()
        digests = b"".join(int(value).to_bytes(8, "little", signed=True) for value in per_rank[:, 1].tolist())
        params = hashlib.blake2b(digests, digest_size=8).hexdigest()
        self._write({"step": step, "loss": sum(losses) / len(losses), "grad_norm": norm, "params": params})

    def _write(self, record: dict[str, Any]) -> None:
        if self.fabric.global_rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def parameter_hash(model: torch.nn.Module) -> int:
    """A 64-bit BLAKE2b hash of this rank's parameters: their names and the bytes of its local shards."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # a DTensor: this rank's part
        digest.update(name.encode())
        digest.update(local.detach().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return int.from_bytes(digest.digest(), "little", signed=True)


def read_fingerprints(run: str | Path) -> tuple[Path, dict[int, dict[str, Any]], list[int]]:
    """(the file, step -> its fingerprint as last written, the step each restart began at) of a run folder or file.

    A resumed run rewrites the steps after its checkpoint: the later line of a step replaces the earlier. A line
    cut short (the process killed while writing it) is skipped.
    """
    path = Path(run)
    path = path / FINGERPRINTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise RecipeError(
            f"fingerprints {str(run)!r}: no {FINGERPRINTS_FILE} there (train with --logger.fingerprint true)"
        )
    steps: dict[int, dict[str, Any]] = {}
    restarts: list[int] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            steps[int(record["step"])] = record
        elif isinstance(record, dict) and "started_at_step" in record:
            restarts.append(int(record["started_at_step"]))
    return path, steps, restarts[1:]


def first_divergence(
    first: dict[int, dict[str, Any]], second: dict[int, dict[str, Any]], tolerance: float = 0.0
) -> tuple[int, list[str]] | None:
    """(the first step both runs recorded whose fingerprints differ, how each field differs), or None.

    Loss and gradient norm are compared to `tolerance`; the parameter hash only when it is 0 (bitwise).
    """
    for step in sorted(first.keys() & second.keys()):
        differences = [
            how
            for name in COMPARED
            if (how := _field_difference(name, first[step].get(name), second[step].get(name), tolerance))
        ]
        if differences:
            return step, differences
    return None


def _field_difference(name: str, first: Any, second: Any, tolerance: float) -> str | None:
    """How one field of a step's fingerprints differs, in words; None when equal (to the tolerance)."""
    if first == second or (name == "params" and tolerance > 0):
        return None
    if isinstance(first, float) and isinstance(second, float):
        gap = abs(first - second)
        return None if gap <= tolerance else f"{name} {first} in A, {second} in B (difference {gap:.3g})"
    return f"{name} {first} in A, {second} in B"


def divergence_lines(first_run: str, second_run: str, tolerance: float = 0.0) -> tuple[list[str], bool]:
    """What `checkpoint compare --fingerprints` prints, and whether the runs agree at every step both recorded."""
    lines, runs = [], []
    for label, run in (("A", first_run), ("B", second_run)):
        path, steps, restarts = read_fingerprints(run)
        runs.append(steps)
        span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps"
        restarted = f", restarted at step {', '.join(map(str, restarts))}" if restarts else ""
        lines.append(f"{label}  {path}: {span}{restarted}")
    shared = sorted(runs[0].keys() & runs[1].keys())
    compared = f"loss and grad_norm within {tolerance:g}, params not compared" if tolerance else ", ".join(COMPARED)
    found = first_divergence(runs[0], runs[1], tolerance)
    if found is None:
        lines.append(f"the runs agree at all {len(shared)} steps both recorded ({compared})")
        return lines, True
    step, differences = found
    lines.append(f"first divergence at step {step}: {differences[0]}")
    lines += [f"  also {difference}" for difference in differences[1:]]
    agreed = [s for s in shared if s < step]
    if agreed:
        lines.append(f"the runs agree at the {len(agreed)} steps both recorded before it ({agreed[0]}-{agreed[-1]})")
    else:
        lines.append("it is the first step both recorded")
    return lines, False
