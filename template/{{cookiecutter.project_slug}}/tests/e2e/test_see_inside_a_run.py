"""One 2-process run, profiled in its first steps with its last rank made slow after them: a trace per rank
holding the profiled steps, the slow rank named in the log and the metrics, and a report of the run's
logs (a resumed run's segments and marks: tests/unit/test_report.py, on the same CSV layout)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import read_csv_metrics, run_cli, train_args

pytestmark = pytest.mark.slow
SLEEP = 0.5  # seconds the last rank sleeps in each step from step 9 on (TRAIN_FAULT=slow-rank)
# Windows of 4 steps with a margin of 0.6 (of 2 ranks, one named when it takes over 4x the other): a stall of a
# loaded machine in the clean window (steps 5-8) is averaged over 4 steps and stays under it; the slow one is ~13x.
MARGIN = 0.6


def run_args(out_dir: Path, max_steps: int) -> list[str]:
    return train_args(
        out_dir, "--train.max_steps", str(max_steps), "--profile.steps", "[1, 2]", "--profile.ranks", "[]",
        "--logger.log_every_steps", "4", "--logger.straggler_margin", str(MARGIN), "--eval.every_steps", "0",
        "--checkpoint.save_every_steps", "0",
        "--checkpoint.resume", "auto",
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out_dir = tmp_path_factory.mktemp("inside") / "run"
    first = run_cli(*run_args(out_dir, max_steps=12), fault=f"slow-rank:9:{SLEEP}")
    return {"out_dir": out_dir, "first": first}


def test_every_rank_writes_a_chrome_trace_of_the_profiled_steps_only(run: dict) -> None:
    first, out_dir = run["first"], run["out_dir"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Profiling steps 1-2 on rank(s) every rank" in first.stdout
    traces = sorted((out_dir / "profile").rglob("*.json"))
    assert [path.relative_to(out_dir / "profile").as_posix() for path in traces] == [
        "steps-1-2/rank0.pt.trace.json",
        "steps-1-2/rank1.pt.trace.json",
    ]
    for trace in traces:
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {"step 1", "step 2"} <= names and "step 3" not in names, trace
        assert any(name and name.startswith("aten::") for name in names), trace  # the model's operations


def test_the_slow_rank_is_named_in_the_log_and_in_the_metrics(run: dict) -> None:
    first, out_dir = run["first"], run["out_dir"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert re.search(r"step 12/12 \| straggler: rank 1 takes [\d.]+ s per step before the ranks sync", first.stdout)
    # Before the fault nobody is slow: steps 5-8 name nobody; steps 1-4, a process's first window, never do.
    assert not re.search(r"step [48]/12 \| straggler", first.stdout)
    rows = {int(row["step"]): row for row in read_csv_metrics(out_dir) if row.get("stragglers/straggler_rank")}
    assert [float(rows[step]["stragglers/straggler_rank"]) for step in (4, 8)] == [-1, -1]
    assert float(rows[12]["stragglers/straggler_rank"]) == 1 and float(rows[12]["stragglers/slowest_rank"]) == 1
    assert float(rows[12]["stragglers/slowest_step_seconds"]) > SLEEP
    assert "host peak rss per rank (GiB): 0: " in first.stdout  # each rank's peak memory


def test_report_draws_the_runs_own_logs_into_one_page(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    first, out_dir = run["first"], run["out_dir"]
    assert first.returncode == 0, first.stderr[-3000:]
    from {{ cookiecutter.package_name }}.cli import main

    main(["report", str(out_dir)])
    page = out_dir / "report" / "report.html"
    assert f"Report: {page}" in capsys.readouterr().out
    text = page.read_text()
    assert "<td>start</td><td>csv/version_0</td><td>1-12</td>" in text and "<td>restart" not in text
    assert text.count('src="data:image/png;base64,') >= 6
    assert (out_dir / "report" / "stragglers.png").is_file()
