"""Long commands show that they work (a line every few seconds in a log file); quick work shows nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from {{ cookiecutter.package_name }} import progress


@pytest.fixture
def fast_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines after 0.05 s instead of seconds."""
    monkeypatch.setattr(progress, "SHOW_AFTER_SECONDS", 0.05)
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 0.05)


def test_quick_work_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.working("Loading x"):
        pass
    assert list(progress.counted(range(3), "Verifying y", total=3)) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")


def test_long_work_shows_lines_while_it_runs_and_its_duration(
    fast_clock: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with progress.working("Loading step-00000040"):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and lines[0].startswith("Loading step-00000040: 0 s ...")
    assert lines[-1].startswith("Loading step-00000040: done in 0.")


def test_counted_items_show_how_many_are_done_in_a_log(fast_clock: None, capsys: pytest.CaptureFixture[str]) -> None:
    def slow_items() -> Iterator[int]:
        for item in range(4):
            time.sleep(0.06)
            yield item

    assert list(progress.counted(slow_items(), "Verifying data/prepared", total=4, unit="files")) == [0, 1, 2, 3]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("Verifying data/prepared: 1/4 files (")
    assert lines[-1].startswith("Verifying data/prepared: 4/4 files in ")


def test_a_failure_is_not_reported_as_done(fast_clock: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError), progress.working("Consolidating z"):
        time.sleep(0.1)
        raise ValueError("refused")
    assert "done" not in capsys.readouterr().err
