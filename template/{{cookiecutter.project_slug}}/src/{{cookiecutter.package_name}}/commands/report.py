"""`<project> report RUN_DIR`: the run's metrics drawn into one self-contained HTML file (and its PNGs), offline.

It reads the CSV metrics every run keeps under <out_dir>/csv/ (whatever logger.name, except none): one
folder `version_<n>` per process lifetime, so each restart starts a new segment, drawn in its own colour
and marked where it starts; steps whose update was skipped (train.on_nonfinite_loss=skip) are marked
too. Every figure is drawn against the step and, beside it, against wall time. The HTML embeds its
PNGs as data URIs and refers to nothing outside itself, so it can be copied off a cluster and opened
anywhere. Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

import base64
import csv
import html
import importlib.util
import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from ..checkpoint.provenance import LOGGED_FILE, recorded, short_commit
from ..errors import RecipeError
from ..project import PROJECT
from ..training import goodput
from . import parse_arguments

HELP = f"Plot a run's metrics into one HTML file: {PROJECT} report RUN_DIR."
TIME_KEY = "time/unix_time"  # logged at every logging step (training/monitor.py): the time axis
TIME_UNITS = [("seconds", 1.0), ("minutes", 60.0), ("hours", 3600.0)]  # the first under 120 of them spans the run

# (file name, title, metric keys or key prefixes drawn together, y-axis label)
FIGURES: list[tuple[str, str, list[str], str]] = [
    ("loss", "Loss", ["train/loss", "val/loss"], "loss"),
    ("validation", "Validation", ["val/"], "value"),
    ("learning_rate", "Learning rate", ["train/lr"], "learning rate"),
    ("grad_norm", "Gradient norm (before clipping)", ["train/grad_norm"], "norm"),
    ("throughput", "Throughput", ["throughput/*_per_second"], "per second"),
    ("mfu", "Model FLOP utilisation", ["throughput/mfu"], "MFU"),
    ("memory", "Peak memory (worst rank)", ["memory/"], "GiB"),
    ("data_wait", "Step time and data wait", ["time/step_seconds", "time/data_wait_seconds"], "seconds per step"),
    ("stragglers", "Slowest rank against the median", ["stragglers/*_step_seconds"], "seconds per step"),
    ("startup", "Start-up phases of each lifetime", ["goodput/phase/"], "seconds"),
]


@dataclass
class Segment:
    """The metrics one process lifetime logged: metric -> [(step, value, unix time or nan)]."""

    name: str
    series: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    provenance: dict[str, Any] | None = None  # what made it (commit, versions, hosts, launcher); None: not logged

    @property
    def steps(self) -> list[int]:
        return sorted({step for points in self.series.values() for step, _, _ in points})


@dataclass
class RunGoodput:
    """What the run's restarts cost and its goodput, from the figures each lifetime logged (training/goodput.py)."""

    lost_seconds: list[float | None]  # per segment: start-up + redone steps x step time; None: not logged
    step_seconds: float  # the run's median step time
    steps: int  # the furthest step reached
    wall_seconds: float  # from the first launch (or the first logged time) to the last logged time
    goodput: float


def run_goodput(segments: list[Segment]) -> RunGoodput:
    """Lost time per lifetime and the run's goodput: its steps, each once at its median step time, over wall time."""
    step_times = [value for segment in segments for _, value, _ in segment.series.get(goodput.STEP_SECONDS, [])]
    step_seconds = statistics.median(step_times) if step_times else math.nan
    lost: list[float | None] = []
    for segment in segments:
        startup, redone = _first(segment, goodput.STARTUP), _first(segment, goodput.REDONE)
        lost.append(goodput.lost_seconds(startup, int(redone or 0), step_seconds) if startup is not None else None)
    moments = [t for segment in segments for points in segment.series.values() for _, _, t in points if t == t]
    launches = [value for segment in segments for _, value, _ in segment.series.get(goodput.LAUNCHED, [])]
    start = min(launches + moments, default=math.nan)
    wall = max(moments, default=math.nan) - start
    steps = max(segment.steps[-1] for segment in segments)
    return RunGoodput(lost, step_seconds, steps, wall, goodput.run_goodput(steps, step_seconds, wall))


def _first(segment: Segment, key: str) -> float | None:
    points = segment.series.get(key)
    return points[0][1] if points else None


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`report`'s arguments: the run folder and where to write."""
    parser.description = "Draw a run's logged metrics into report.html (PNGs embedded) and PNG files."
    parser.add_argument("run", help="The run's out_dir (its csv/ folder holds the metrics).")
    parser.add_argument("--out", default=None, help="Folder to write into (default: RUN/report).")


def run(argv: list[str], prog: str) -> None:
    """Write the report of a run and print its path."""
    args = parse_arguments(prog, "report", add_arguments, argv)
    if importlib.util.find_spec("matplotlib") is None:
        raise RecipeError(f'report needs matplotlib: pip install "{PROJECT}[report]"')
    run_dir = Path(args.run)
    segments = read_segments(run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    page = write_report(run_dir, segments, out)
    print(f"Report: {page} (open it in a browser; PNGs beside it)")


def read_segments(run_dir: Path) -> list[Segment]:
    """One segment per CSV metrics file of the run, in the order the run wrote them."""
    if not run_dir.is_dir():
        raise RecipeError(f"report: {str(run_dir)!r} is not a folder (give a run's out_dir)")
    files = sorted(run_dir.glob("csv/**/version_*/metrics.csv"), key=_version_order)
    if not files:
        raise RecipeError(
            f"report: no CSV metrics under {run_dir}/csv/ (every run logs them, except with logger.name=none)"
        )
    segments = []
    for path in files:
        segment = Segment(str(path.parent.relative_to(run_dir)))
        segment.provenance = _logged_provenance(path.parent / LOGGED_FILE)
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                rows = [row for row in csv.DictReader(handle) if (row.get("step") or "").strip()]
        except (UnicodeDecodeError, csv.Error) as error:
            raise RecipeError(f"report: {path} is not a CSV file of UTF-8 text ({error})") from None
        steps = [_step(path, row["step"]) for row in rows]
        # The time of a step: from its training row, for the other rows of that step (validation, checkpoint).
        times = {step: _number(row.get(TIME_KEY)) for step, row in zip(steps, rows, strict=True) if row.get(TIME_KEY)}
        for step, row in zip(steps, rows, strict=True):
            for key, text in row.items():
                value = _number(text)
                if key in ("step", TIME_KEY) or key is None or math.isnan(value):
                    continue
                segment.series.setdefault(key, []).append((step, value, times.get(step, math.nan)))
                if key == "train/skipped_updates":
                    segment.skipped_steps.append(step)
        if segment.series:
            segments.append(segment)
    if not segments:
        raise RecipeError(f"report: the CSV files under {run_dir}/csv/ hold no metrics yet")
    return segments


def _logged_provenance(path: Path) -> dict[str, Any] | None:
    """The provenance a segment's logger folder holds, or None (a run of an older version, an unreadable file or
    one that is not a provenance)."""
    try:
        provenance = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return recorded(provenance)


def _made_by(provenance: dict[str, Any] | None) -> list[str]:
    """The report's provenance cells of a segment: commit, versions, launcher and hosts."""
    if provenance is None:
        return ["not recorded", "", ""]
    versions = ", ".join(f"{name} {value}" for name, value in provenance.get("versions", {}).items() if value)
    hosts = ", ".join(provenance.get("hosts") or [])
    return [short_commit(provenance), versions, f"{provenance.get('launcher', 'unknown')} on {hosts or 'unknown'}"]


def _version_order(path: Path) -> tuple[str, int]:
    name = path.parent.name.removeprefix("version_")
    return str(path.parent.parent), int(name) if name.isdigit() else 0


def _step(path: Path, text: str) -> int:
    """A row's step: a whole number (written as 12 or 12.0), else one line naming the file and the value."""
    value = _number(text)
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise RecipeError(f"report: {path} has step={text.strip()[:40]!r}, not a step number (a whole number >= 0)")
    return int(value)


def _number(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def _matches(key: str, pattern: str) -> bool:
    if "*" in pattern:
        start, end = pattern.split("*", 1)
        return key.startswith(start) and key.endswith(end) and "flops" not in key
    return key.startswith(pattern) if pattern.endswith("/") else key == pattern


def write_report(run_dir: Path, segments: list[Segment], out: Path) -> Path:
    """Draw the figures as PNGs into `out` and write `out/report.html` embedding them; return the HTML's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if out.exists() and not out.is_dir():
        raise RecipeError(f"report: --out {out} is a file, not a folder (the report is a folder: HTML and PNGs)")
    out.mkdir(parents=True, exist_ok=True)
    # Metric names are labels as written: `$` or `_` in a name is not TeX (mathtext would refuse some of them).
    matplotlib.rcParams["text.parse_math"] = False
    keys = sorted({key for segment in segments for key in segment.series})
    moments = [t for s in segments for points in s.series.values() for _, _, t in points if t == t]
    start_time = min(moments, default=0.0)
    span = max(moments, default=0.0) - start_time
    time_unit = next((unit for unit in TIME_UNITS if span <= unit[1] * 120), TIME_UNITS[-1])
    images = []
    for name, title, patterns, ylabel in FIGURES:
        chosen = [key for key in keys if any(_matches(key, pattern) for pattern in patterns)]
        if name == "validation":
            chosen = [key for key in chosen if key != "val/loss"]
        if name == "throughput" and len(chosen) > 1:  # the task's unit, not samples too (another scale)
            chosen = [key for key in chosen if key != "throughput/samples_per_second"]
        if not chosen:
            continue
        figure, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
        _draw(axes[0], segments, chosen, start_time=start_time)
        _draw(axes[1], segments, chosen, start_time=start_time, time_unit=time_unit[1])
        axes[0].set_ylabel(ylabel)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel(f"{time_unit[0]} since the run started")
        figure.suptitle(title)
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        images.append((title, path))
    page = out / "report.html"
    page.write_text(_html(run_dir, segments, images))
    return page


def _draw(axis: Any, segments: list[Segment], keys: list[str], start_time: float, time_unit: float = 0.0) -> None:
    """Each key's points per segment against the step, or against time in units of `time_unit` seconds when given;
    a restart's first step and skipped updates marked."""
    by_time = time_unit > 0
    colours = [f"C{i}" for i in range(10)]
    styles = ["-", "--", ":", "-."]
    for index, segment in enumerate(segments):
        for key_index, key in enumerate(keys):
            points = segment.series.get(key, [])
            if by_time:
                pairs = [((t - start_time) / time_unit, v) for _, v, t in points if t == t]  # nan: no time logged
            else:
                pairs = [(float(step), v) for step, v, _ in points]
            if not pairs:
                continue
            label = key if index == 0 else None
            axis.plot(*zip(*pairs, strict=True), styles[key_index % 4], color=colours[index % 10], label=label,
                      marker="." if len(pairs) < 30 else None)  # fmt: skip
        moments = [t for points in segment.series.values() for _, _, t in points if t == t]
        restart_at = ((min(moments) - start_time) / time_unit if moments else None) if by_time else segment.steps[0]
        if index > 0 and restart_at is not None:
            axis.axvline(restart_at, color="grey", linestyle="--", linewidth=1)
            axis.annotate(f"restart {index}", (restart_at, 1), xycoords=("data", "axes fraction"),
                          rotation=90, va="top", ha="right", fontsize=8, color="grey")  # fmt: skip
        if not by_time:
            for step in segment.skipped_steps:
                axis.axvline(step, color="red", linestyle=":", linewidth=1)
    if by_time and not axis.lines:
        axis.text(0.5, 0.5, f"no {TIME_KEY} logged", transform=axis.transAxes, ha="center", color="grey")
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    axis.grid(alpha=0.3)


def _seconds(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.1f}"


def _goodput_line(costs: RunGoodput) -> str:
    """The run's goodput in one sentence: its productive step time over its wall time, and what restarts lost."""
    if not math.isfinite(costs.goodput):
        return "Goodput: not known (no step time or wall time logged)."
    restarts = [lost for lost in costs.lost_seconds[1:] if lost is not None]
    lost = f"; {len(restarts)} restart(s) lost {sum(restarts):.1f} s" if restarts else ""
    return (
        f"Goodput {costs.goodput:.1%}: {costs.steps} steps at {costs.step_seconds:.3f} s"
        f" ({costs.steps * costs.step_seconds:.1f} s of training) in {costs.wall_seconds:.1f} s of wall time"
        f" (restarts, saves and validation included){lost}."
    )


STYLE = "body { font-family: sans-serif; margin: 2em; max-width: 1100px } img { max-width: 100% }"
STYLE += " table { border-collapse: collapse } td, th { border: 1px solid #ccc; padding: 4px 8px }"


def _html(run_dir: Path, segments: list[Segment], images: list[tuple[str, Path]]) -> str:
    """The report page: a table of the segments, then each figure as an embedded PNG; no outside references."""
    rows = []
    costs = run_goodput(segments)
    for index, segment in enumerate(segments):
        steps = segment.steps
        kind = "start" if index == 0 else f"restart {index}"
        skipped = ", ".join(map(str, segment.skipped_steps)) or "none"
        startup, redone = _first(segment, goodput.STARTUP), _first(segment, goodput.REDONE)
        rows.append(
            f"<tr><td>{kind}</td><td>{html.escape(segment.name)}</td><td>{steps[0]}-{steps[-1]}</td>"
            f"<td>{skipped}</td><td>{_seconds(startup)}</td><td>{'' if redone is None else int(redone)}</td>"
            f"<td>{_seconds(costs.lost_seconds[index])}</td>"
            + "".join(f"<td>{html.escape(cell)}</td>" for cell in _made_by(segment.provenance))
            + "</tr>"
        )
    figures = []
    for title, path in images:
        encoded = base64.b64encode(path.read_bytes()).decode("ascii")
        figures.append(
            f'<h2>{html.escape(title)}</h2>\n<img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'
        )
    written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Run report: {html.escape(str(run_dir))}</title>
<style>{STYLE}</style></head>
<body><h1>Run report: {html.escape(str(run_dir))}</h1>
<p>Written {written} from the run's CSV metrics. Each process lifetime is one segment, in its own colour;
a grey dashed line marks where a restart began, a red dotted line a skipped update. The table names the code and
package versions each segment ran with, and what each start cost: its start-up (launch to the end of its first
step), the steps it redid (logged by an earlier lifetime after the checkpoint it resumed from) and the two as time
lost (start-up + redone steps x the run's median step time).</p>
<p>{_goodput_line(costs)}</p>
<table><tr><th>segment</th><th>logs</th><th>steps</th><th>skipped updates</th><th>start-up (s)</th>
<th>redone steps</th><th>lost (s)</th><th>commit</th><th>versions</th><th>launcher and hosts</th></tr>
{chr(10).join(rows)}
</table>
{chr(10).join(figures)}
</body></html>
"""
