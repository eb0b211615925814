"""`report` draws a run's CSV metrics into one self-contained HTML file: segments per restart, marks, no links."""

from __future__ import annotations

import contextlib
import csv
import io
import re
from pathlib import Path

import pytest
from helpers import fail_with, run_cli_without

from {{ cookiecutter.package_name }}.commands.report import Segment, _draw, read_segments, run_goodput


def write_metrics(path: Path, rows: list[dict[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted({key for row in rows for key in row})
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def train_row(step: int, start: float = 1.7e9) -> dict[str, float]:
    return {
        "step": step,
        "train/loss": 5.0 - step / 10,
        "train/lr": 1e-3,
        "train/grad_norm": 1.0,
        "throughput/samples_per_second": 10.0,
        "throughput/units_per_second": 640.0,
        "memory/host_peak_rss_gib": 0.5,
        "time/step_seconds": 0.2,
        "time/data_wait_seconds": 0.01,
        "time/unix_time": start + step,
    }


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed after step 4 and resumed from its step-3 checkpoint, with a skipped update at step 2."""
    run = tmp_path_factory.mktemp("report") / "run"
    first = [train_row(step) for step in range(1, 5)] + [{"step": 2, "train/skipped_updates": 1}]
    first.append({"step": 4, "val/loss": 4.7, "val/perplexity": 110.0})
    first.append(startup_row(1, launched=1.7e9 - 9, startup=10.0, redone=0))  # 10 s from launch to step 1's end
    write_metrics(run / "csv" / "version_0" / "metrics.csv", first)
    second = [train_row(step, 1.7e9 + 60) for step in range(4, 9)]
    second.append(startup_row(4, launched=1.7e9 + 52, startup=12.0, redone=1))  # step 4 again: once more
    write_metrics(run / "csv" / "version_1" / "metrics.csv", second)
    return run


def startup_row(step: int, launched: float, startup: float, redone: int) -> dict[str, float]:
    """What a lifetime logs at its first step (training/goodput.py): its start-up, in phases, and redone steps."""
    phases = {"imports": 0.4, "rendezvous": 0.2, "model_build": 0.1, "checkpoint_load": 0.1, "first_step": 0.2}
    return {
        "step": step,
        "goodput/launched_unix_time": launched,
        "goodput/startup_seconds": startup,
        "goodput/redone_steps": redone,
        "goodput/lost_seconds": startup,  # the live estimate; the report recomputes it at the run's step time
        **{f"goodput/phase/{phase}_seconds": share * startup for phase, share in phases.items()},
    }


@pytest.fixture(scope="module")
def report_output(resumed_run: Path) -> str:
    """What `report RUN --out RUN/elsewhere` printed (it writes the page and the PNGs there)."""
    from {{ cookiecutter.package_name }}.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["report", str(resumed_run), "--out", str(resumed_run / "elsewhere")])
    return printed.getvalue()


def test_report_of_a_resumed_run_draws_both_segments_and_marks_the_restart_and_the_skipped_update(
    resumed_run: Path, report_output: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert f"Report: {resumed_run / 'elsewhere' / 'report.html'}" in report_output
    for name in ("loss", "validation", "learning_rate", "grad_norm", "throughput", "memory", "data_wait"):
        assert (resumed_run / "elsewhere" / f"{name}.png").stat().st_size > 1000, name

    segments = read_segments(resumed_run)
    assert [segment.steps for segment in segments] == [[1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert segments[0].skipped_steps == [2]
    for time_unit in (0.0, 1.0):  # against the step, and against time
        figure, axis = plt.subplots()
        _draw(axis, segments, ["train/loss"], start_time=1.7e9 + 1, time_unit=time_unit)
        drawn = [line for line in axis.lines if len(line.get_xdata()) > 2]
        assert [line.get_color() for line in drawn] == ["C0", "C1"]  # one curve per segment, each its colour
        verticals = {(line.get_color(), line.get_linestyle(), line.get_xdata()[0]) for line in axis.lines}
        restart = 4 if time_unit == 0 else 63.0  # its first step; its first logged time, from the run's start
        assert ("grey", "--", restart) in verticals
        assert ("red", ":", 2) in verticals or time_unit  # skipped updates: on the step axis
        plt.close(figure)


def test_the_report_page_embeds_its_images_and_refers_to_nothing_outside_itself(
    resumed_run: Path, report_output: str
) -> None:
    text = (resumed_run / "elsewhere" / "report.html").read_text()
    assert len(re.findall(r'<img alt="[^"]+" src="data:image/png;base64,[A-Za-z0-9+/=]+">', text)) >= 7
    sources = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]+)""", text)
    assert sources and all(source.startswith("data:image/png;base64,") for source in sources)
    outside = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)  # base64 may hold "//"
    assert not re.search(r"https?:|//|url\(|@import|<script|<link|<iframe", outside)
    assert "restart 1" in text and "<td>4-8</td>" in text and "<td>2</td>" in text  # the segments table


def test_report_refuses_a_folder_without_metrics_and_a_missing_plotting_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "is not a folder" in fail_with(["report", str(tmp_path / "missing")], capsys)
    assert "no CSV metrics under" in fail_with(["report", str(tmp_path)], capsys)
    result = run_cli_without(("matplotlib",), "report", str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == 'error: report needs matplotlib: pip install "{{ cookiecutter.project_slug }}[report]"'


def test_segment_steps_are_the_steps_of_any_metric() -> None:
    segment = Segment("version_0", {"a": [(1, 0.0, 0.0), (3, 0.0, 0.0)], "b": [(2, 1.0, 0.0)]})
    assert segment.steps == [1, 2, 3]


def csv_run(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "run" / "csv" / "version_0" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return tmp_path / "run"


# (id, the metrics file's bytes, what the one line must say)
MALFORMED_CSV = [
    ("a step that is a word", b"step,train/loss\n1,2.0\nlast,1.0\n", "has step='last', not a step number"),
    ("a fractional step", b"step,train/loss\n1.5,2.0\n", "has step='1.5', not a step number"),
    ("an infinite step", b"step,train/loss\ninf,2.0\n", "has step='inf', not a step number"),
    ("bytes that are not UTF-8", b"step,train/loss\n1,2.0\n2,\xff\xfe\n", "is not a CSV file of UTF-8 text"),
]


@pytest.mark.parametrize(("case_id", "content", "message"), MALFORMED_CSV, ids=[case[0] for case in MALFORMED_CSV])
def test_a_malformed_metrics_file_is_refused_in_one_line(
    case_id: str, content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = csv_run(tmp_path, content)
    assert message in fail_with(["report", str(run)], capsys)
    assert not (run / "report").exists()


def test_a_metric_name_that_is_not_tex_is_drawn_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from {{ cookiecutter.package_name }}.cli import main

    run = csv_run(tmp_path, b"step,val/$x^{$ cost,val/a_b\n1,2.0,1.0\n2,1.5,1.0\n")  # mathtext: unbalanced brace
    main(["report", str(run)])
    assert (run / "report" / "validation.png").is_file()


def test_report_refuses_an_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = csv_run(tmp_path, b"step,train/loss\n1,2.0\n")
    (tmp_path / "taken.html").write_text("mine")
    assert "--out" in fail_with(["report", str(run), "--out", str(tmp_path / "taken.html")], capsys)
    assert (tmp_path / "taken.html").read_text() == "mine"


@pytest.mark.parametrize("written", ['"made by me"', '{"versions": ["torch"]}', '{"hosts": "node-1"}'])
def test_a_logged_provenance_that_is_not_one_is_reported_as_not_recorded(written: str, tmp_path: Path) -> None:
    from {{ cookiecutter.package_name }}.cli import main

    run = csv_run(tmp_path, b"step,train/loss\n1,2.0\n2,1.5\n")
    (run / "csv" / "version_0" / "provenance.json").write_text(written)
    with contextlib.redirect_stdout(io.StringIO()):
        main(["report", str(run)])
    assert "<td>not recorded</td>" in (run / "report" / "report.html").read_text()


def test_report_gives_each_restart_its_lost_time_and_the_run_its_goodput(resumed_run: Path, report_output: str) -> None:
    costs = run_goodput(read_segments(resumed_run))
    assert costs.step_seconds == pytest.approx(0.2) and costs.steps == 8
    # start-up + redone steps x the run's median step time
    assert costs.lost_seconds == [pytest.approx(10.0), pytest.approx(12.0 + 1 * 0.2)]
    # from the first launch (1.7e9 - 9) to the last logged time (1.7e9 + 68): 8 steps of 0.2 s in 77 s
    assert costs.wall_seconds == pytest.approx(77.0) and costs.goodput == pytest.approx(8 * 0.2 / 77)
    text = (resumed_run / "elsewhere" / "report.html").read_text()
    assert "<td>10.0</td><td>0</td><td>10.0</td>" in text  # the first start: start-up, redone steps, lost
    assert "<td>12.0</td><td>1</td><td>12.2</td>" in text  # the restart
    assert "Goodput 2.1%: 8 steps at 0.200 s (1.6 s of training) in 77.0 s of wall time" in text
    assert "1 restart(s) lost 12.2 s" in text
    assert (resumed_run / "elsewhere" / "startup.png").stat().st_size > 1000


def test_a_run_logged_without_goodput_figures_reports_no_lost_time() -> None:
    segment = Segment("version_0", {"time/step_seconds": [(1, 0.5, 100.0), (2, 0.5, 101.0)]})
    costs = run_goodput([segment])
    assert costs.lost_seconds == [None]
    assert costs.goodput == pytest.approx(2 * 0.5 / 1.0)  # wall time from the first logged time only
