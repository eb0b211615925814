"""A small corpus in the three input formats `prepare` reads, made in code (offline, deterministic)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from {{ cookiecutter.package_name }}.tasks.language_model.data import make_demo_text


def write_corpus(folder: Path, lines_per_part: int = 100) -> list[str]:
    """.txt, .jsonl and .parquet files under `folder`; returns the documents in the order prepare reads them."""
    lines = make_demo_text().splitlines()
    part = [lines[i * lines_per_part : (i + 1) * lines_per_part] for i in range(4)]
    folder.mkdir(parents=True, exist_ok=True)
    # Files are read in sorted path order: a.txt, b.txt, c.jsonl, d/e.parquet.
    first = "\n".join(part[0]) + "\nNon-ASCII survives: naïve café, Ünïcödé, 東京, 🚀.\n"
    second = "\n".join(part[1]) + "\n"
    (folder / "a.txt").write_text(first, encoding="utf-8")
    (folder / "b.txt").write_text(second, encoding="utf-8")
    records = [" ".join(part[2][i : i + 3]) for i in range(0, len(part[2]), 3)]
    with (folder / "c.jsonl").open("w", encoding="utf-8") as handle:
        for index, text in enumerate(records):
            handle.write(json.dumps({"id": index, "text": text}) + "\n")
            if index == 1:  # an empty document and a blank line: both skipped
                handle.write(json.dumps({"id": -1, "text": ""}) + "\n\n")
    rows = [" ".join(part[3][i : i + 3]) for i in range(0, len(part[3]), 3)]
    (folder / "d").mkdir(exist_ok=True)
    pq.write_table(pa.table({"text": rows, "id": list(range(len(rows)))}), folder / "d" / "e.parquet")
    return [first, second, *records, *rows]
