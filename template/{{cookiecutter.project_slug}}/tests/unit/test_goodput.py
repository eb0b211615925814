"""What start-up and failures cost a run: the arithmetic each lifetime logs and `report` sums (training/goodput.py)."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.training.goodput import (
    IMPORTED_AT,
    PHASES,
    StartupClock,
    earlier_lifetimes,
    lost_seconds,
    phase_key,
    process_start_time,
    run_goodput,
)


def test_phases_are_the_times_between_their_ends_from_the_launch() -> None:
    clock = StartupClock(launched=100.0)
    clock.finished = {"imports": 103.0, "rendezvous": 104.5, "model_build": 105.0, "first_step": 107.0}
    # checkpoint_load never marked (a run that stopped before it): none of the time is its
    assert clock.phase_seconds() == {
        "imports": 3.0,
        "rendezvous": 1.5,
        "model_build": 0.5,
        "checkpoint_load": 0.0,
        "first_step": 2.0,
    }
    assert sum(clock.phase_seconds().values()) == 7.0  # the start-up: launch to the first step's end
    assert list(clock.phase_seconds()) == list(PHASES)


def test_marking_a_phase_records_now() -> None:
    clock = StartupClock(launched=time.time() - 1)
    clock.mark("imports")
    assert 0.99 <= clock.phase_seconds()["imports"] < 5


def test_the_launch_is_this_process_start_before_anything_was_imported() -> None:
    launched = process_start_time()
    assert launched <= IMPORTED_AT <= time.time()
    assert time.time() - launched < 3600  # this test's own process, not the machine's boot


def test_lost_time_is_start_up_plus_redone_steps_at_the_step_time() -> None:
    assert lost_seconds(10.0, 0, 0.35) == 10.0
    assert lost_seconds(10.0, 12, 0.5) == 16.0


def test_goodput_is_each_step_once_over_the_wall_time() -> None:
    assert run_goodput(100, 0.35, 50.0) == pytest.approx(0.7)
    assert run_goodput(100, 1.0, 50.0) == 1.0  # never above 1 (a step time measured on a slower window)
    assert math.isnan(run_goodput(100, 0.35, 0.0)) and math.isnan(run_goodput(1, math.nan, 10.0))


def test_earlier_lifetimes_give_the_furthest_step_their_step_times_and_the_first_launch(tmp_path: Path) -> None:
    rows = [
        [
            {"step": 1, phase_key("imports"): 2.0, "goodput/launched_unix_time": 500.0},
            {"step": 4, "time/step_seconds": 0.3},
        ],
        [{"step": 9, "goodput/launched_unix_time": 400.0}, {"step": 12, "time/step_seconds": 0.4}, {"step": 13}],
    ]
    paths = []
    for index, lifetime in enumerate(rows):
        paths.append(tmp_path / f"version_{index}" / "metrics.csv")
        paths[-1].parent.mkdir()
        with paths[-1].open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=sorted({key for row in lifetime for key in row}))
            writer.writeheader()
            writer.writerows(lifetime)
    (tmp_path / "version_2").mkdir()
    (tmp_path / "version_2" / "metrics.csv").write_bytes(b"step\n\xff\xfe\n")  # unreadable: left out
    earlier = earlier_lifetimes([*paths, tmp_path / "version_2" / "metrics.csv", tmp_path / "missing.csv"])
    assert earlier.furthest_step == 13
    assert earlier.step_seconds == [0.3, 0.4]
    assert earlier.first_launch == 400.0


def test_a_restarted_lifetime_logs_its_start_up_once_and_the_steps_an_earlier_one_logged_past_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    from {{ cookiecutter.package_name }}.training.goodput import GOODPUT, LAUNCHED, LOST, REDONE, STARTUP, Goodput

    earlier = tmp_path / "csv" / "version_0" / "metrics.csv"  # a lifetime that logged up to step 12, then died
    earlier.parent.mkdir(parents=True)
    earlier.write_text(f"step,time/step_seconds,{LAUNCHED}\n1,,{time.time() - 60}\n10,0.5,\n12,0.5,\n")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[CSVLogger(root_dir=tmp_path / "csv", name="")])
    logged: list[tuple[dict[str, float], int]] = []
    monkeypatch.setattr(fabric, "log_dict", lambda metrics, step: logged.append((metrics, step)))
    clock = StartupClock(launched=time.time() - 3)
    clock.mark("imports")
    goodput = Goodput(fabric, clock, start_step=8)  # resumed from the checkpoint of step 8

    goodput.step_done(9)
    goodput.step_done(10)  # once per lifetime
    ((figures, step),) = logged
    assert step == 9 and figures[REDONE] == 4  # steps 9-12 again
    assert 3 <= figures[STARTUP] < 10 and figures[STARTUP] == pytest.approx(sum(figures[phase_key(p)] for p in PHASES))
    assert figures[LOST] == pytest.approx(figures[STARTUP] + 4 * 0.5)  # at the earlier lifetimes' step time
    # 10 steps at the median step time (0.5) over the ~60 s since the first lifetime's launch
    assert goodput.figures(10, 0.5)[GOODPUT] == pytest.approx(10 * 0.5 / 60, rel=0.1)
