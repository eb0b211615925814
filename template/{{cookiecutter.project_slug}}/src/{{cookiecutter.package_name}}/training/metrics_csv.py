"""The CSV metrics every run keeps (what `report` reads), written so that a full disk ends the run as a failed
save does: one line, exit SAVE_FAILED (74), the rows written so far intact.

Fabric's CSVLogger appends each flush's rows, and rewrites the whole file when a new metric appears (the header
grows); written in place, a rewrite that meets a full disk leaves the file cut short. Here the rewrite goes to a
temporary file renamed over the old one, and a full disk or quota stops the run instead of a traceback.
"""

from __future__ import annotations

import csv
import errno
import os

from lightning.fabric.loggers import CSVLogger
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.fabric.loggers.logger import rank_zero_experiment

from ..errors import ExitCode, TrainingStopped

FULL = (errno.ENOSPC, errno.EDQUOT)


class _MetricsWriter(_ExperimentWriter):
    """Fabric's writer, whose header rewrite replaces the file whole (a temporary file, then a rename)."""

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            rows = list(csv.DictReader(file))
        temporary = self.metrics_file_path + ".partial"
        try:
            with self._fs.open(temporary, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=fieldnames)
                writer.writeheader()
                writer.writerows(rows)
            os.replace(temporary, self.metrics_file_path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)


class MetricsCsv(CSVLogger):
    """Fabric's CSVLogger with the writer above; a full disk while writing ends the run with SAVE_FAILED."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _ExperimentWriter:
        """The writer (created on first use, on rank 0 only, as Fabric's)."""
        if self._experiment is None:
            os.makedirs(self._root_dir, exist_ok=True)
            self._experiment = _MetricsWriter(log_dir=self.log_dir)
        return self._experiment

    def save(self) -> None:
        """Write the rows logged since the last save; a full disk stops the run in one line."""
        try:
            super().save()
        except OSError as error:
            if error.errno not in FULL:
                raise
            raise TrainingStopped(
                f"metrics not written: no space left on the device of {self.log_dir} ({error.strerror}); the rows"
                " written so far are kept: free space there, then resume with checkpoint.resume=auto",
                ExitCode.SAVE_FAILED,
            ) from None
