"""A multiple-choice lm-eval task made here: a YAML file and a jsonl of 8 questions, read offline through
`include_path` (no download)."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "choose_the_word"
QUESTIONS = [  # (question, choices, index of the answer)
    ("The cat sat on the", ["mat", "sky", "river", "idea"], 0),
    ("Water boils at one hundred degrees", ["Celsius", "blue", "running", "table"], 0),
    ("The opposite of hot is", ["loud", "cold", "green", "fast"], 1),
    ("A week has seven", ["days", "wheels", "songs", "roots"], 0),
    ("Birds fly with their", ["wings", "spoons", "books", "doors"], 0),
    ("The sun rises in the", ["cupboard", "piano", "east", "soup"], 2),
    ("Two plus two makes", ["seven", "purple", "four", "window"], 2),
    ("At night we see the", ["moon", "carpet", "engine", "letter"], 0),
]


def write_task(folder: Path) -> Path:
    """An lm-eval multiple-choice task in `folder`: its YAML file and its local jsonl data."""
    folder.mkdir(parents=True)
    with (folder / "questions.jsonl").open("w") as handle:
        for question, choices, answer in QUESTIONS:
            handle.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'questions.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: question\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    return folder
