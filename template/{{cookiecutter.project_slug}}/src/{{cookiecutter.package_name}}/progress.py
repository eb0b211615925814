"""What a long command shows while it works (loading, consolidating, exporting, verifying or preparing data), on stderr.

Quick work shows nothing. Work that lasts longer than a few seconds shows a tqdm bar on a terminal,
and in a log file (SLURM, `nohup`) one plain line every LINE_EVERY_SECONDS, then how long it took.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

Item = TypeVar("Item")
SHOW_AFTER_SECONDS = 3.0  # quicker work stays silent
LINE_EVERY_SECONDS = 10.0  # in a log file


@contextmanager
def working(what: str, enabled: bool = True) -> Iterator[None]:
    """Around work with no count to show: a line every LINE_EVERY_SECONDS while it runs, then its duration."""
    started, finished = time.perf_counter(), threading.Event()

    def heartbeat() -> None:
        wait = SHOW_AFTER_SECONDS
        while not finished.wait(wait):
            print(f"{what}: {time.perf_counter() - started:.0f} s ...", file=sys.stderr, flush=True)
            wait = LINE_EVERY_SECONDS

    thread = threading.Thread(target=heartbeat, daemon=True) if enabled else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        finished.set()
        if thread is not None:
            thread.join()
    seconds = time.perf_counter() - started
    if enabled and seconds >= SHOW_AFTER_SECONDS:
        print(f"{what}: done in {seconds:.1f} s", file=sys.stderr, flush=True)


def counted(items: Iterable[Item], what: str, total: int | None = None, unit: str = "it") -> Iterator[Item]:
    """Yield `items`, showing how many are done: a bar on a terminal, else a line every LINE_EVERY_SECONDS."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=what, total=total, unit=unit, file=sys.stderr, delay=SHOW_AFTER_SECONDS)
        return
    started = last = time.perf_counter()
    done = 0
    of = f"/{total}" if total is not None else ""
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= (SHOW_AFTER_SECONDS if last == started else LINE_EVERY_SECONDS):
            print(f"{what}: {done}{of} {unit} ({now - started:.0f} s)", file=sys.stderr, flush=True)
            last = now
    if last != started:  # lines were shown: close with the total
        print(f"{what}: {done}{of} {unit} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


class Meter:
    """Work with a known total, counted as it is done (`advance`): a tqdm bar on a terminal, else a plain line
    every LINE_EVERY_SECONDS (a log file, a batch job) that `line` words from the count so far."""

    def __init__(self, what: str, total: int, unit: str, line: Callable[[int], str], enabled: bool = True) -> None:
        self.what, self.line, self.enabled, self.done = what, line, enabled, 0
        self.bar = None
        self._last_line = time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            columns, rows = shutil.get_terminal_size()  # tqdm reads 0 columns on some ptys and hides the bar
            self.bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=what, file=sys.stderr,
                            ncols=columns, nrows=rows)  # fmt: skip

    def advance(self, amount: int) -> None:
        """Count `amount` more units done."""
        self.done += amount
        if self.bar is not None:
            self.bar.update(amount)
        elif self.enabled and time.monotonic() - self._last_line >= LINE_EVERY_SECONDS:
            self._last_line = time.monotonic()
            print(f"{self.what}: {self.line(self.done)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()
